"""A user's session through the daemon on a real GPU, for every shape the planner serves with
an emulated card budget (tests/gpu/session.py): nothing dies, nothing goes unanswered, the card
stays within the budget, and the expert pool computes what the model computes without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import pytest


from matrix import BUDGETS_GIB, ROOT, ROUTING, SHAPES, gpu_engine, selected

# Skipped where there is no NVIDIA GPU or the engine lacks the project's patches: the CPU suite
# (CI) collects these and moves on. (No conftest.py here: its module name would shadow
# tests/conftest.py's for the CPU suite's `from conftest import ...`.)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(bool(gpu_engine()), reason=gpu_engine())]


MOE = tuple(s for s in SHAPES if s != "llama-8b")


@pytest.fixture(scope="session")
def synthetic():
    """shape name -> its synthetic Q4_0 model (written on first use, kept for the session)."""
    from scripts import synth_gguf

    directory = Path(os.environ.get("LOCALLLM_GPU_MODELS", "/tmp/models"))

    def model(shape: str) -> Path:
        return synth_gguf.ensure_model(directory, synth_gguf.SHAPES[shape],
                                       routing=ROUTING.get(shape, "zipf:0.3")
                                       if synth_gguf.SHAPES[shape].n_expert else "uniform")

    return model


def _failures(session) -> list[str]:
    """Steps that went unanswered, or whose runner changed without an unload asking it."""
    return [f"{st.name}: {[a.error[:300] for a in st.answers if a.error] or 'runner changed'}"
            for st in session.steps
            if not st.ok or (st.runner_before not in (None, st.runner_after)
                             and st.name != "unload and reload")]


def _run(synthetic, tmp_path, shape: str, budget: float, steps, **settings):
    from session import Session

    s = Session(synthetic(shape), budget, tmp_path, **settings)
    s.card.start()
    try:
        steps(s)
    finally:
        peak = s.card.stop()
        log = s.log_tail(60)
        s.stop()
    used = (peak - s.baseline) >> 20
    print(f"{shape} at {budget} GiB: peak {used} of {s.budget_mib} MiB")  # -rA shows it
    return s, used, log


@pytest.mark.parametrize("budget", selected("LOCALLLM_GPU_BUDGETS", BUDGETS_GIB))
@pytest.mark.parametrize("shape", selected("LOCALLLM_GPU_SHAPES", SHAPES))
def test_a_whole_session_is_answered_within_the_budget(synthetic, tmp_path, shape, budget):
    """Short prompts, a long prompt that moves the runner into the next fill band, follow-ups
    on that prefix (the batch of a few new tokens that killed the runner on Qwen3-30B-A3B), a
    new chat, 4 at once, a stream cut mid-way, an unload and reload: all with default
    settings."""
    from session import full_session

    s, peak, log = _run(synthetic, tmp_path, shape, budget, full_session)
    assert not _failures(s), f"{_failures(s)}\n{log}"
    assert peak <= s.budget_mib, f"peak {peak} MiB over the {s.budget_mib} MiB budget\n{log}"


@pytest.mark.parametrize("setting", ["LOCALLLM_EXPERT_CACHE=off", "LOCALLLM_EXPERT_MISSES=cpu",
                                     "LOCALLLM_EXPERT_MISSES=gpu"])
@pytest.mark.parametrize("shape", selected("LOCALLLM_GPU_SHAPES", MOE))
def test_the_crash_sequence_with_each_expert_setting(synthetic, tmp_path, shape, setting):
    from session import crash_sequence

    if shape not in MOE:
        pytest.skip("a dense model has no experts")
    name, value = setting.split("=")
    s, peak, log = _run(synthetic, tmp_path, shape, 12, crash_sequence, **{name: value})
    assert not _failures(s), f"{_failures(s)}\n{log}"
    assert peak <= s.budget_mib


CHECK = ("-m", "scripts.moe_cache_check")  # run from ROOT


def _check(model, *args: str, slots: int = 0) -> dict:
    pool = ("--slots", str(slots)) if slots else ()
    run = subprocess.run([sys.executable, *CHECK, str(model), "--gpu", "--threads", "16",
                          *pool, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("shape", selected("LOCALLLM_GPU_SHAPES", MOE))
def test_the_pool_computes_what_the_model_computes_without_it(synthetic, tmp_path, shape):
    """Greedy texts are no test here: random weights leave near-ties (top logits closer than
    a GPU kernel's rounding) at which the same request read twice already picks otherwise.
    So the pool's run is forced along the run without it and the logits compared step by step.
    An expert computed on the GPU rounds otherwise than on the CPU (ggml-cuda quantizes the
    activations to q8_1, the CPU to q8_0): on the H200 that moved the top logits by 3% of
    their spread on average and 11-18% at most, and flipped 1 near-tie pick of 48, the same
    with a pool of 0 slots (every expert from the CPU's copy, only the rounding differs). A
    wrong expert moves them by their whole spread (another model: most picks differ). So:
    the mean move under 5%, the largest under 30%, 90% of the picks the same. A 12-row verify
    pass through the pool (CUDA's batched kernels, where repeated pool ids once corrupted
    memory) must answer too."""
    if shape not in MOE:
        pytest.skip("a dense model has no experts")
    model = synthetic(shape)
    off = tmp_path / "off.json"
    off.write_text(json.dumps(_check(model, "--tokens", "48")))
    on = tmp_path / "on.json"
    on.write_text(json.dumps(_check(model, "--force", str(off), slots=64)))
    compared = subprocess.run([sys.executable, *CHECK, "--compare", str(off), str(on)],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)
    figures = json.loads(compared.stdout)
    print(shape, figures)
    assert figures["same_greedy"] >= 0.9, figures
    assert figures["mean_rel_move"] < 0.05 and figures["max_rel_move"] < 0.3, figures
    verified = _check(model, "--tokens", "24", "--verify", "12", slots=64)
    assert verified["stats"] and verified["stats"]["steps"] > 0
