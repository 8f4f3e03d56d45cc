"""The MoE expert cache of patches/0002-moe-expert-cache.patch, on the CPU backend: the pool of
expert slots in RAM (`pool_in_ram`), so that the split of every decode step's experts between
the pool and the model's own tensors runs with no GPU. Real llama.cpp (the engine install.sh
built with the patches) in child processes (moe_cache_check.py gives the cache's settings to the
engine before it creates a context: engine/expert_cache.py), on a tiny synthetic qwen3moe: 4 MoE
blocks of 32 experts, 4 routed per token, every weight drawn; one file with skewed routing
(zipf:1), one uniform. The slot bookkeeping (eviction order) is compiled from the patch and run
alone."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from scripts import synth_gguf

from localllm.engine import expert_cache

ROOT = Path(__file__).resolve().parent.parent
PATCH = ROOT / "patches" / "0002-moe-expert-cache.patch"
CHECK = ("-m", "scripts.moe_cache_check")  # run from ROOT
LAYERS, EXPERTS, USED = 4, 32, 4
TOKENS = 48  # generated: the prompt's batch, then TOKENS - 1 one-token decodes
PROMPT = 40  # 32 or more: the prompt batch's FFNs keep today's path, but for its last block


def _shape(name: str):
    tiny = synth_gguf.tiny(synth_gguf.SHAPES["qwen3-30b-a3b"])
    return dataclasses.replace(tiny, name=name, n_layer=LAYERS, n_expert=EXPERTS,
                               n_expert_used=USED)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("moe")
    return {routing: synth_gguf.write_gguf(directory / f"{routing}.gguf", _shape("moe-cache"),
                                           "Q4_0", "noise", routing=routing)
            for routing in ("zipf:1", "uniform")}


VERIFY = 5  # then the output again, 5 tokens a batch, every row's logits: verification batches


def _run(model: Path, *extra: str, slots: int | None = None, pool_in_ram: bool = False,
         swaps: int = 0, zero_slot: bool | None = None, misses_on_gpu: bool = False) -> dict:
    """moe_cache_check.py on `model`, its pool from the options (expert_cache.Settings' fields,
    given to the engine through patches/0006; no slots: none). The environment's
    LLAMA_MOE_CACHE_* variables are left as they are: the engine must not read them."""
    cache = [] if slots is None else ["--slots", str(slots), "--swaps", str(swaps)]
    cache += ["--pool-in-ram"] * pool_in_ram + ["--misses-on-gpu"] * misses_on_gpu
    if zero_slot is not None:
        cache += ["--zero-slot", str(int(zero_slot))]
    result = subprocess.run(
        [sys.executable, *CHECK, str(model), "--prompt", str(PROMPT),
         "--tokens", str(TOKENS), "--verify", str(VERIFY), *cache, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def without_cache(models) -> dict[str, dict]:
    return {routing: _run(path) for routing, path in models.items()}


def _lookups(steps: int) -> int:
    # every routed expert of every block of every one-token step, plus the prompt batch's
    # last block, which computes the output row alone (1 row: a small batch)
    return LAYERS * USED * steps + USED


def _same_answers(on: dict, off: dict) -> None:
    assert on["tokens"] == off["tokens"]
    assert on["verify_argmax"] == off["verify_argmax"]
    assert len(on["verify_argmax"]) == TOKENS


@pytest.mark.parametrize("zero_slot", [False, True], ids=["misses-skipped", "misses-on-zero-slot"])
def test_greedy_answers_are_the_same_with_the_cache_on(models, without_cache, zero_slot):
    """One-token steps and verification batches alike; misses skipped by the pool (id -1, a
    pool in RAM) or computed against its slot of zeros (a GPU pool's way)."""
    for routing, path in models.items():
        off = without_cache[routing]
        assert off["stats"] is None  # no slots given: no cache
        assert len(set(off["tokens"])) > 5  # the model's output varies: a real comparison
        on = _run(path, slots=8, pool_in_ram=True, swaps=2, zero_slot=zero_slot)
        _same_answers(on, off)
        assert on["stats"]["layers"] == LAYERS and on["stats"]["slots"] == 8


def test_every_lookup_is_a_hit_or_a_miss_and_swaps_stay_bounded(models):
    on = _run(models["zipf:1"], slots=8, pool_in_ram=True, swaps=2)
    single, total = on["stats_single"], on["stats"]
    assert single["steps"] == on["steps"] + 1  # + the prompt batch (its last block)
    assert single["hits"] + single["misses"] == _lookups(on["steps"])
    # the free slots fill at once (evicting nothing), then at most 2 evictions a step
    assert 8 <= single["swaps"] <= 8 + 2 * single["steps"]
    assert single["hits"] > 0
    # the verification batches go through the cache too: every row of every block
    verify_lookups = total["hits"] + total["misses"] - single["hits"] - single["misses"]
    assert verify_lookups == LAYERS * USED * TOKENS
    assert total["steps"] == single["steps"] + -(-TOKENS // VERIFY)
    assert total["swaps"] <= 8 + 2 * total["steps"]


def test_a_prompt_fills_the_pool_before_the_answer_starts(models):
    # the prompt batch (40 rows: not served by the pool) counts what its blocks use, and the
    # free slots take the most used; its last block (1 row) is the one step the pool serves
    on = _run(models["zipf:1"], "--tokens", "1", slots=16, pool_in_ram=True)
    single = on["stats_single"]
    assert single["swaps"] == 16
    assert single["steps"] == 1
    assert single["hits"] + single["misses"] == USED


def test_skewed_routing_hits_more_than_uniform(models):
    rates = {}
    for routing, path in models.items():
        stats = _run(path, slots=16, pool_in_ram=True)["stats_single"]
        rates[routing] = stats["hits"] / (stats["hits"] + stats["misses"])
    # 16 slots for 4 x 32 experts: measured 0.62 skewed, 0.16 uniform (a token repeated
    # in the output routes as before)
    assert rates["zipf:1"] > 0.3 > rates["uniform"], rates


@pytest.mark.parametrize("zero_slot", [False, True], ids=["misses-skipped", "misses-on-zero-slot"])
def test_a_pool_with_no_slots_misses_everything_and_answers_the_same(models, without_cache,
                                                                    zero_slot):
    on = _run(models["zipf:1"], slots=0, pool_in_ram=True, zero_slot=zero_slot)
    _same_answers(on, without_cache["zipf:1"])
    stats = on["stats_single"]
    assert stats["hits"] == 0 and stats["swaps"] == 0
    assert stats["misses"] == _lookups(on["steps"])


def test_misses_asked_of_a_gpu_stay_on_the_cpu_where_the_pool_has_none(models, without_cache):
    """Misses on the GPU (patches/0003) need a pool on a GPU that can read RAM in
    place; with the pool in RAM the engine keeps the misses on the CPU, says so in its figures,
    and answers as before."""
    on = _run(models["zipf:1"], slots=8, pool_in_ram=True, misses_on_gpu=True)
    _same_answers(on, without_cache["zipf:1"])
    assert on["stats_single"]["misses_on_gpu"] == 0
    assert on["stats_single"]["hits"] > 0


def _compare(a: Path, b: Path) -> dict:
    result = subprocess.run([sys.executable, *CHECK, "--compare", str(a), str(b)], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_forced_tokens_compare_the_logits_step_by_step(models, without_cache, tmp_path):
    """--force decodes another run's tokens, --compare says how far each step's top logits
    moved: the way to judge a GPU pool, whose rounding flips near-tie greedy picks. A pool in
    RAM does the CPU's own arithmetic: nothing moves. Another model over the same tokens
    picks otherwise: the comparison sees it."""
    off = tmp_path / "off.json"
    off.write_text(json.dumps(without_cache["zipf:1"]))
    on = tmp_path / "on.json"
    on.write_text(json.dumps(_run(models["zipf:1"], "--force", str(off), slots=8,
                                  pool_in_ram=True)))
    assert json.loads(on.read_text())["tokens"] == without_cache["zipf:1"]["tokens"]
    assert _compare(off, on) == {"steps": TOKENS, "same_greedy": 1.0, "max_rel_move": 0.0,
                                 "mean_rel_move": 0.0}
    other = tmp_path / "other.json"
    other.write_text(json.dumps(_run(models["uniform"], "--force", str(off))))
    assert _compare(off, other)["same_greedy"] < 0.5


def test_no_gpu_and_no_cpu_pool_leaves_the_cache_off(models, without_cache):
    on = _run(models["zipf:1"], slots=8)  # the pool's default home is a GPU: none here
    assert on["stats"] is None
    assert on["tokens"] == without_cache["zipf:1"]["tokens"]


def test_settings_refuse_a_negative_pool_or_swaps():
    with pytest.raises(ValueError, match="slots must be 0 or more"):
        expert_cache.Settings(expert_cache=-1)
    with pytest.raises(ValueError, match="swaps must be 0 or more"):
        expert_cache.Settings(expert_cache=4, expert_cache_swaps=-1)


def _context(llama_cpp, model):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = 1
    ctx = llama_cpp.llama_init_from_model(model, params)
    assert ctx
    return ctx


def test_the_engine_takes_the_settings_given_not_the_environment(models, monkeypatch):
    """patches/0006: a context created inside switched_on gets the settings' pool, any other
    none, though the environment asks llama.cpp for one (its LLAMA_MOE_CACHE_* variables are
    read only by a process that never gave settings: llama.cpp's own tools). So the runner's
    drafter and embedding contexts, made after the target's, get no pool."""
    import llama_cpp

    monkeypatch.setenv("LLAMA_MOE_CACHE_SLOTS", "4")
    monkeypatch.setenv("LLAMA_MOE_CACHE_DEVICE", "cpu")
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False  # the pool is filled from the experts' bytes as in the file
    mparams.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(models["zipf:1"]).encode(), mparams)
    assert model
    contexts = []
    try:
        pool = expert_cache.Settings(expert_cache=8, expert_cache_device="cpu")
        with expert_cache.switched_on(pool):
            contexts.append(_context(llama_cpp, model))
        contexts.append(_context(llama_cpp, model))  # after: none, whatever the environment
        with expert_cache.switched_on(None):
            contexts.append(_context(llama_cpp, model))
        target, after, plain = (expert_cache.read(ctx) for ctx in contexts)
    finally:
        for ctx in contexts:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    assert target is not None and target.slots == 8 and target.layers == LAYERS
    assert after is None and plain is None


# ---- the slot bookkeeping alone, compiled from the patch ----------------------------------

POLICY_TEST = r"""
#include "llama-moe-cache-policy.h"
#include <cstdio>
static void end(llama_moe_cache_policy & p, bool served) {
    for (const auto & s : p.plan(served))
        printf("swap slot=%d in=%d.%d out=%d.%d\n",
               s.slot, s.layer, s.expert, s.old_layer, s.old_expert);
    printf("end hits=%lld misses=%lld steps=%lld\n",
           (long long) p.hits, (long long) p.misses, (long long) p.steps);
}
static void step(llama_moe_cache_policy & p, std::initializer_list<std::pair<int, int>> routed) {
    for (auto [layer, expert] : routed) { int32_t e = expert; p.observe(layer, &e, 1); }
    end(p, true);
}
int main() {
    llama_moe_cache_policy p(2, 4, 2, 0.5f, 1);  // 2 layers x 4 experts, 2 slots, 1 eviction a step
    step(p, {{0, 0}, {0, 1}, {1, 2}});  // both free slots fill at once; 1.2, no hotter, waits
    step(p, {{1, 2}});            // 1.2 (1.5) evicts the coldest holder, 0.0 (0.5; first of two)
    step(p, {{0, 0}, {0, 3}});    // 0.0 (1.25) evicts 0.1 (0.25); 0.3: one eviction a step
    step(p, {{1, 2}, {0, 0}});    // both hit: nothing moves
    llama_moe_cache_policy q(1, 4, 2, 0.9f, 4);  // a prompt batch fills the pool, no lookups
    const int32_t prompt[] = {3, 3, 1, 3, 2, 1};
    q.learn(0, prompt, 6);
    end(q, false);                // the two most used, 0.3 then 0.1, take the free slots
    step(q, {{0, 3}, {0, 2}});    // a hit and a miss; 0.2 (1.9) evicts 0.1 (1.8)
    return 0;
}
"""


def _new_file(patch: str, name: str) -> str:
    """The text of a file that the patch creates (every line added)."""
    part = patch.split(f"+++ b/vendor/llama.cpp/src/{name}\n", 1)[1]
    part = re.split(r"\ndiff ", part, maxsplit=1)[0]
    return "".join(line[1:] + "\n" for line in part.splitlines() if line.startswith("+"))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_policy_fills_free_slots_at_once_evicts_the_coldest_and_learns_from_prompts(tmp_path):
    (tmp_path / "llama-moe-cache-policy.h").write_text(
        _new_file(PATCH.read_text(), "llama-moe-cache-policy.h"))
    (tmp_path / "t.cpp").write_text(POLICY_TEST)
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp_path / "t"), str(tmp_path / "t.cpp"),
                    "-I", str(tmp_path)], check=True, timeout=120)
    out = subprocess.run([str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "swap slot=0 in=0.0 out=-1.-1", "swap slot=1 in=0.1 out=-1.-1",
        "end hits=0 misses=3 steps=1",
        "swap slot=0 in=1.2 out=0.0", "end hits=0 misses=4 steps=2",
        "swap slot=1 in=0.0 out=0.1", "end hits=0 misses=6 steps=3",
        "end hits=2 misses=6 steps=4",
        "swap slot=0 in=0.3 out=-1.-1", "swap slot=1 in=0.1 out=-1.-1",
        "end hits=0 misses=0 steps=0",
        "swap slot=1 in=0.2 out=0.1", "end hits=1 misses=1 steps=1",
    ]


# ---- the build -----------------------------------------------------------------------------

def test_the_installed_engine_carries_the_patch():
    import llama_cpp.llama_cpp as llama_lib

    assert hasattr(llama_lib._lib, "llama_moe_cache_stats")
    assert hasattr(llama_lib._lib, "llama_moe_cache_set_params")  # patches/0006


def _wheel_dir(repo: Path) -> str:
    return subprocess.run(["bash", str(repo / "scripts" / "install.sh"), "--wheel-dir"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def test_the_wheel_key_names_the_patches(tmp_path):
    without = tmp_path / "repo"
    shutil.copytree(ROOT / "scripts", without / "scripts")
    shutil.copytree(ROOT / "patches", without / "patches")
    (without / "patches" / PATCH.name).unlink()
    assert _wheel_dir(without) != _wheel_dir(ROOT)


@pytest.mark.network
def test_the_patches_apply_to_the_engine_source(tmp_path):
    fetched = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
         "-d", str(tmp_path), "llama-cpp-python==0.3.36"],
        capture_output=True, text=True, timeout=300)
    if fetched.returncode != 0:
        pytest.skip(f"no llama-cpp-python source from the package index: {fetched.stderr[-300:]}")
    with tarfile.open(next(tmp_path.glob("llama_cpp_python-0.3.36.tar.gz"))) as tar:
        tar.extractall(tmp_path, filter="data")
    src = tmp_path / "llama_cpp_python-0.3.36"
    applied = subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), str(src)],
                             capture_output=True, text=True, timeout=120)
    assert applied.returncode == 0, applied.stderr
    assert "patched: 0002-moe-expert-cache.patch" in applied.stdout
    assert (src / "vendor/llama.cpp/src/llama-moe-cache.cpp").is_file()


def test_the_device_build_refuses_source_made_from_other_patches(tmp_path):
    """The GPU machine's build (lab/device/build_patched.sh) checks the carried source's
    stamp (lab/device/carry_patched_source.sh writes it) against this checkout's patches before
    it compiles: a stale tarball would measure another engine, or fail after the build."""
    def build(stamp: str | None) -> subprocess.CompletedProcess:
        tree = tmp_path / (stamp or "none") / "llama.cpp"
        tree.mkdir(parents=True)
        if stamp is not None:
            (tree / "LOCALLLM_PATCHES").write_text(stamp + "\n")
        tgz = tmp_path / f"{stamp or 'none'}.tgz"
        with tarfile.open(tgz, "w:gz") as tar:
            tar.add(tree, arcname="llama.cpp")
        return subprocess.run(["bash", "lab/device/build_patched.sh", str(tgz),
                               str(tmp_path / "engine")], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)

    ours = subprocess.run(["bash", "scripts/apply_patches.sh", "--hash"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout.strip()
    for stamp in ("0123456789abcdef", None):
        refused = build(stamp)
        assert refused.returncode == 1
        assert f"made from patches {stamp or 'none'}, this checkout has {ours}" in refused.stderr
        assert "carry_patched_source.sh" in refused.stderr
        assert not (tmp_path / "engine").exists(), "nothing was built"


POLICY_DRIVER = r"""
#include "llama-moe-cache-policy.h"
#include <cstdio>
#include <vector>
int main() {  // the policy under commands from stdin: o LAYER N IDS..., l LAYER N WEIGHT IDS...,
             // p (served) or q
    int n_layer, n_expert, n_slots, max_swaps; float decay;
    if (scanf("%d %d %d %f %d", &n_layer, &n_expert, &n_slots, &decay, &max_swaps) != 5) return 1;
    llama_moe_cache_policy p(n_layer, n_expert, n_slots, decay, max_swaps);
    char op;
    while (scanf(" %c", &op) == 1) {
        if (op == 'o' || op == 'l') {
            int layer, n;
            float weight = 1.0f;
            if (scanf("%d %d", &layer, &n) != 2) return 1;
            if (op == 'l' && scanf("%f", &weight) != 1) return 1;
            std::vector<int32_t> ids(n);
            for (auto & id : ids) if (scanf("%d", &id) != 1) return 1;
            if (op == 'o') p.observe(layer, ids.data(), n);
            else p.learn(layer, ids.data(), n, weight);
            continue;
        }
        for (const auto & s : p.plan(op == 'p'))
            printf("%d %d %d\n", s.slot, s.layer*n_expert + s.expert,
                   s.old_layer < 0 ? -1 : s.old_layer*n_expert + s.old_expert);
        printf("end %lld %lld %lld %lld\n", (long long) p.hits, (long long) p.misses,
               (long long) p.swaps, (long long) p.steps);
    }
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler")
def test_the_replays_policy_swaps_and_counts_as_the_engines(tmp_path):
    """scripts/bench/pool_replay.py's port, which chose the planner's swaps a step, against the
    engine's policy compiled from the patch: the same swaps, hits and misses on a skewed
    session of prompt batches (each use weighed 1/rows, as the engine counts them) and
    steps."""
    import numpy as np
    from scripts.bench.pool_replay import Policy

    (tmp_path / "llama-moe-cache-policy.h").write_text(
        _new_file(PATCH.read_text(), "llama-moe-cache-policy.h"))
    (tmp_path / "d.cpp").write_text(POLICY_DRIVER)
    subprocess.run(["g++", "-std=c++17", "-O1", "-o", str(tmp_path / "d"), str(tmp_path / "d.cpp"),
                    "-I", str(tmp_path)], check=True, timeout=120)
    layers, experts, slots, decay, swaps = 3, 16, 10, 0.9, 2
    rng = np.random.default_rng(7)
    popularity = 1.0 / np.arange(1, experts + 1)  # Zipf-like, a shuffled order per layer
    orders = [rng.permutation(experts) for _ in range(layers)]
    commands, ours = [f"{layers} {experts} {slots} {decay} {swaps}"], []
    policy = Policy(layers, experts, slots, decay, swaps)

    def routed(layer: int, rows: int) -> list[int]:
        return [int(e) for _ in range(rows) for e in orders[layer][
            rng.choice(experts, 3, replace=False, p=popularity / popularity.sum())]]

    for step in range(120):
        served = step % 40 != 0  # every 40th a prompt batch of 12 rows
        for layer in range(layers):
            ids = routed(layer, 1 if served else 12)
            if served:
                commands.append(f"o {layer} {len(ids)} {' '.join(map(str, ids))}")
                policy.observe(layer, ids)
            else:
                weight = np.float32(1 / 12)  # printed as it rounds back
                commands.append(f"l {layer} {len(ids)} {weight} {' '.join(map(str, ids))}")
                policy.learn(layer, ids, weight)
        commands.append("p" if served else "q")
        ours += [f"{slot} {new} {old}" for slot, new, old in policy.plan(served)]
        ours.append(f"end {policy.hits} {policy.misses} {policy.swaps} {policy.steps}")
    engine = subprocess.run([str(tmp_path / "d")], input="\n".join(commands) + "\n",
                            capture_output=True, text=True, check=True, timeout=60).stdout
    assert engine.splitlines() == ours
    assert policy.hits > 0 and policy.swaps > slots  # evictions happened, not only fills
