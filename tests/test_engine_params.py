"""A dry run builds exactly the model and context params the runner loads with: both go through
engine/params.py, and this checks what really reaches llama.cpp on each path (the real functions
run; the test only records the params they were given)."""

from __future__ import annotations

import llama_cpp
import pytest

from localllm.engine import model as runner_model
from localllm.engine import dryrun
from localllm.planner.plan import Plan, TensorOverride


def _fields(struct) -> dict:
    out = {}
    for name, _ in struct._fields_:
        value = getattr(struct, name)
        out[name] = value if isinstance(value, (int, float, bool, bytes, type(None))) else \
            repr(type(value))
        if name in ("tensor_buft_overrides", "devices", "tensor_split"):
            out[name] = bool(value)  # pointers: set or not (each path has its own array)
    return out


@pytest.fixture
def recorded(monkeypatch):
    seen: dict[str, list] = {"model": [], "context": []}
    load, init = llama_cpp.llama_model_load_from_file, llama_cpp.llama_init_from_model

    def record_load(path, params):
        seen["model"].append(_fields(params))
        return load(path, params)

    def record_init(model, params):
        seen["context"].append(_fields(params))
        return init(model, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", record_load)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", record_init)
    return seen


@pytest.mark.parametrize("plan", [
    Plan(n_ctx=1024, n_batch=256, n_ubatch=128, n_parallel=2, type_k="q8_0", type_v="q8_0",
         flash_attn=True, n_threads=2, n_threads_batch=2),
    Plan(n_ctx=512, speculative="lookup", draft_n_max=5,
         tensor_overrides=(TensorOverride(r"^output\.weight$", "CPU"),)),
], ids=["slots-q8", "lookup-overrides"])
def test_the_dry_run_builds_the_runners_params(smollm2_gguf, recorded, plan):
    lm = runner_model.load(str(smollm2_gguf), plan)
    llama_cpp.llama_free(lm.ctx)
    llama_cpp.llama_model_free(lm.model)
    dryrun.run(str(smollm2_gguf), plan)
    (run_model, dry_model), (run_ctx, dry_ctx) = recorded["model"], recorded["context"]
    assert dry_model.pop("no_alloc") and not run_model.pop("no_alloc")
    assert dry_model.pop("load_mode") == llama_cpp.LLAMA_LOAD_MODE_NONE
    run_model.pop("load_mode")
    assert run_model == dry_model
    assert run_ctx == dry_ctx
    assert run_ctx["n_seq_max"] == max(1, plan.n_parallel)
    assert run_ctx["n_rs_seq"] == (plan.draft_n_max + 1 if plan.speculative != "off" else 0)
    assert bool(run_model["tensor_buft_overrides"]) == bool(plan.tensor_overrides)


@pytest.mark.parametrize("use_mmap", [True, False])
def test_every_setting_reaches_a_field_llama_cpp_reads(smollm2_gguf, recorded, use_mmap):
    """ctypes takes an assignment to a name outside a struct's fields as a Python attribute,
    silently: `use_mmap`, renamed `load_mode` in llama.cpp, did nothing that way."""
    from localllm.engine.params import context_params, model_params

    plan = Plan(n_ctx=512, use_mmap=use_mmap)
    params, _ = model_params(plan)
    assert vars(params) == {}, "set outside llama_model_params' fields"
    assert vars(context_params(plan)) == {}, "set outside llama_context_params' fields"
    lm = runner_model.load(str(smollm2_gguf), plan)
    llama_cpp.llama_free(lm.ctx)
    llama_cpp.llama_model_free(lm.model)
    [loaded] = recorded["model"]
    assert loaded["load_mode"] == (llama_cpp.LLAMA_LOAD_MODE_MMAP if use_mmap
                                   else llama_cpp.LLAMA_LOAD_MODE_NONE)


def test_pinning_in_place_falls_back_to_a_pinned_copy_without_cuda(smollm2_gguf, recorded):
    """A plan that pins its mapped weights in place (localllm/engine/host_pin.py) on an engine that
    cannot (here: no CUDA backend) loads them into pinned memory instead: the model loads,
    the second load is llama.cpp's load mode `none`, nothing stays registered."""
    from localllm.engine.host_pin import mapped_ranges

    lm = runner_model.load(str(smollm2_gguf), Plan(n_ctx=512, pin_in_place=True))
    try:
        assert lm.pinned is None
        assert [m["load_mode"] for m in recorded["model"]] == [
            llama_cpp.LLAMA_LOAD_MODE_MMAP, llama_cpp.LLAMA_LOAD_MODE_NONE]
        assert mapped_ranges(str(smollm2_gguf)) == []  # the mapped load was given back
    finally:
        runner_model.free(lm)


def test_mapped_ranges_are_this_process_s_mappings_of_the_file(smollm2_gguf):
    lm = runner_model.load(str(smollm2_gguf), Plan(n_ctx=512))
    try:
        from localllm.engine.host_pin import mapped_ranges

        ranges = mapped_ranges(str(smollm2_gguf))
        assert ranges and all(length > 0 for _, length in ranges)
        assert sum(length for _, length in ranges) <= smollm2_gguf.stat().st_size + 4096
    finally:
        runner_model.free(lm)
    assert mapped_ranges(str(smollm2_gguf)) == []
