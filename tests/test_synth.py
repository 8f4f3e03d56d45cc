"""The synthetic GGUF generator: tensor tables llama.cpp loads, sparse files that cost no disk,
and llama.cpp's own KV sizes for them matching the tuner's memory model."""

from __future__ import annotations

import os

import llama_cpp
import pytest
from scripts import synth_gguf

from localllm.modelstore.shape import read_shape
from localllm.planner.card import load_card
from localllm.profiles.dryrun import dry_run
from localllm.planner.costs import model_costs
from localllm.planner.memory import ContextSettings, memory_by_device
from localllm.planner.placements import Placement
from localllm.planner.plan import Plan


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {name: synth_gguf.write_gguf(d / f"{name}.gguf", synth_gguf.tiny(config), "Q4_0",
                                        "random")
            for name, config in synth_gguf.SHAPES.items()}


@pytest.mark.parametrize("name", list(synth_gguf.SHAPES))
def test_tiny_variant_loads_and_decodes_in_llama_cpp(tiny_models, name):
    llm = llama_cpp.Llama(str(tiny_models[name]), n_ctx=256, n_threads=2, verbose=False)
    try:
        out = llm.create_completion("hello", max_tokens=3, temperature=0.0)
    finally:
        llm.close()
    assert out["usage"]["completion_tokens"] >= 1


def test_sparse_file_has_the_shape_and_uses_no_disk(synth_headers):
    path = synth_headers["dense-27b"]
    shape = read_shape(path)
    st = os.stat(path)
    table = synth_gguf.tensor_table(synth_gguf.SHAPES["dense-27b"])
    assert len(shape.tensors) == len(table)
    assert shape.weight_bytes > 13 * (1 << 30)  # 13.9 GiB of Q4_0
    assert st.st_size >= shape.weight_bytes
    assert st.st_blocks * 512 < 64 << 20  # holes: only the header is on disk


def test_tensor_bytes_follow_the_chosen_type(tmp_path):
    config = synth_gguf.tiny(synth_gguf.SHAPES["llama-8b"])
    q8 = read_shape(synth_gguf.write_gguf(tmp_path / "q8.gguf", config, "Q8_0"))
    q4 = read_shape(synth_gguf.write_gguf(tmp_path / "q4.gguf", config, "Q4_0"))
    w8 = next(t for t in q8.tensors if t.name == "blk.0.ffn_up.weight")
    w4 = next(t for t in q4.tensors if t.name == "blk.0.ffn_up.weight")
    assert (w8.ggml_type, w4.ggml_type) == ("Q8_0", "Q4_0")
    assert w8.n_bytes == 256 * 512 // 32 * 34 and w4.n_bytes == 256 * 512 // 32 * 18


def test_unknown_type_and_fill_are_clear_errors(tmp_path):
    config = synth_gguf.tiny(synth_gguf.SHAPES["llama-8b"])
    with pytest.raises(ValueError, match="unknown ggml type"):
        synth_gguf.write_gguf(tmp_path / "x.gguf", config, "Q9_9")
    with pytest.raises(ValueError, match="fill must be"):
        synth_gguf.write_gguf(tmp_path / "x.gguf", config, "Q4_0", "ones")
    assert synth_gguf.main(["nosuch", str(tmp_path / "y.gguf")]) == 1


@pytest.mark.parametrize("name", list(synth_gguf.SHAPES))
def test_llama_cpp_dry_run_kv_matches_memory_model(synth_headers, home, name):
    """llama.cpp's KV (and recurrent state) for the real tensor table at 32768 with q8_0 KV is
    what the tuner's memory model says, to the byte (the log prints MiB with 2 decimals)."""
    path = synth_headers[name]
    shape = read_shape(path)
    plan = Plan(n_ctx=32768, type_k="q8_0", type_v="q8_0", flash_attn=True)
    result = dry_run(str(path), plan)
    assert result is not None
    costs = model_costs(shape)
    settings = ContextSettings(min(32768, shape.context_length), "q8_0", "q8_0", True, 512)
    memory = memory_by_device(costs, Placement(0), settings, load_card("cpu-only"))
    ours = sum(m.kv for m in memory)
    theirs = result.kv_bytes + result.state_bytes
    assert abs(ours - theirs) <= 0.01 * (1 << 20) * 3


@pytest.fixture(scope="session")
def synth_headers(tmp_path_factory):
    return synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
