"""Issue 13's tuner: attention on the GPU with the FFN in RAM where it wins as the context
fills, decode predicted at the start, middle and end, the quality policy over KV settings, a
pinned kv_cache_type, slots (num_parallel) and the full-size sliding-window cache."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from scripts import synth_gguf

from localllm.modelstore.shape import read_shape
from localllm.planner.card import GIB, MIB, load_card
from localllm.profiles.choose import placement_of
from localllm.planner.budgets import ram_budget, vram_budget
from localllm.planner.search import Request
from localllm.planner.tuner import tune

H200_HOST = dict(ram_bytes=128 * GIB, cores=16, host_bandwidth_gbs=51.2)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return {name: read_shape(path) for name, path in paths.items()}


def h200(gib: float):
    return load_card("h200").with_host(**H200_HOST).with_vram(gib)


def test_ffn_split_wins_at_half_fill_and_whole_blocks_at_the_start(shapes):
    """dense-27b on a 12 GiB budget at 32K: whole blocks are faster after a short prompt, but
    their attention on the CPU makes them 3x slower at depth; averaged over half the context the
    split (every block's attention and KV on the GPU, the FFN of the last blocks in RAM) wins."""
    shape = shapes["dense-27b"]
    plan = tune(shape, h200(12), Request(n_ctx=32768, margin_bytes=128 * MIB))
    placement = placement_of(plan, shape)
    assert plan.n_gpu_layers == shape.n_layer + 1 and placement.n_cpu_ffn_layers > 0
    names = [t.name for t in shape.tensors]
    moved = [n for n in names if any(re.search(o.pattern, n) for o in plan.tensor_overrides)]
    assert moved and all(re.search(r"\.ffn_(up|gate|down)\.", n) for n in moved)
    depths = dict(plan.predicted_decode_by_depth)
    assert sorted(depths) == [0, 16384, 32768]
    assert depths[0] >= depths[16384] >= depths[32768] > 0.8 * depths[0]
    whole = [r for r in plan.reasons if r.startswith("rejected: ") and "whole blocks" in r]
    assert whole, plan.reasons
    start, end = (float(x) for x in re.findall(r"\(([\d.]+) tok/s at the start, ([\d.]+) tok/s",
                                                whole[0])[0])
    assert start > depths[0] and end < depths[32768] / 2  # faster at first, far slower at depth
    assert any("at the start" in r and "16384 tokens" in r for r in plan.reasons)


def test_tune_prints_decode_at_start_middle_and_end(shapes, home):
    path = shapes["dense-27b"].path
    done = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", path, "--card", "h200",
                           "--vram", "12", "--ctx", "32768", "--margin", "128"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"start \(0 tokens\) [\d.]+ tok/s, middle \(16384 tokens\) [\d.]+ tok/s, "
                     r"end \(32768 tokens\) [\d.]+ tok/s", done.stdout)
    assert "FFN of blocks" in done.stdout and "KL divergence" in done.stdout


def test_balanced_keeps_8_bits_where_they_hold_the_kv_and_speed_takes_4(shapes):
    shape = shapes["dense-27b"]
    balanced = tune(shape, h200(12), Request(n_ctx=32768, margin_bytes=128 * MIB))
    speed = tune(shape, h200(12), Request(n_ctx=32768, margin_bytes=128 * MIB, quality="speed"))
    assert balanced.type_k == "q8_0" and speed.type_k == "q4_0"
    assert speed.predicted_decode_tps > balanced.predicted_decode_tps
    assert any("assumed" in r for r in balanced.reasons)
    # At 128K q8_0 cannot keep the KV on the GPU: balanced admits 4 bits and says why.
    long = tune(shape, h200(12), Request(n_ctx=131072, margin_bytes=128 * MIB))
    assert long.type_k == "q4_0"
    assert any("cannot keep this context's KV on the GPU" in r for r in long.reasons)
    # A measured q4_0 cost under the threshold lets balanced take it where it is faster.
    measured = tune(shape, h200(12), Request(n_ctx=32768, margin_bytes=128 * MIB,
                                             measured_kl={"q4_0": 0.004}))
    assert measured.type_k == "q4_0"
    assert any("0.0040" in r and "measured" in r for r in measured.reasons)
    strict = tune(shape, h200(80), Request(n_ctx=32768, quality="max"))
    assert strict.type_k == "f16"


def test_pinned_kv_type_is_used_and_said(shapes):
    plan = tune(shapes["llama-8b"], h200(24), Request(n_ctx=8192, kv_types=("q4_0",)))
    assert (plan.type_k, plan.type_v) == ("q4_0", "q4_0")
    assert any("pinned by kv_cache_type" in r for r in plan.reasons)
    cpu = tune(shapes["llama-8b"], load_card("cpu-only"), Request(kv_types=("q8_0/q4_0",)))
    assert (cpu.type_k, cpu.type_v) == ("q8_0", "q4_0") and cpu.flash_attn


def test_slots_fill_what_is_left_and_never_cost_a_layer(shapes):
    shape = shapes["llama-8b"]
    one = tune(shape, h200(12), Request(n_ctx=8192, num_parallel=1))
    auto = tune(shape, h200(12), Request(n_ctx=8192, num_parallel=None))
    assert auto.n_gpu_layers == one.n_gpu_layers and auto.tensor_overrides == one.tensor_overrides
    assert 1 <= auto.n_parallel <= 4
    kv = {m.device: m.kv for m in auto.memory}
    assert kv["CUDA0"] == auto.n_parallel * {m.device: m.kv for m in one.memory}["CUDA0"]
    assert all(m.total <= vram_budget(h200(12), 512 * MIB) for m in auto.memory
               if m.device != "CPU")
    tight = tune(shapes["dense-27b"], h200(12), Request(n_ctx=32768, num_parallel=None))
    assert tight.n_parallel == 1 and any("a second slot does not fit" in r for r in tight.reasons)
    cpu = load_card("cpu-only").with_host(16 * GIB, 4, 30.0)
    on_cpu = tune(shape, cpu, Request(num_parallel=None))
    assert on_cpu.n_parallel == 4 and on_cpu.ram_bytes() <= ram_budget(cpu)
    capped = tune(shape, cpu, Request(num_parallel=2))
    assert capped.n_parallel == 2


def test_full_swa_cache_for_a_chat_model_with_room(shapes, gemma_gguf, smollm2_gguf):
    # The real Gemma 3 270M base has sliding-window layers and no chat template.
    from dataclasses import replace

    gemma = read_shape(gemma_gguf)
    chat = replace(gemma, chat_template="{{ messages }}")
    roomy = tune(chat, h200(24), Request(n_ctx=8192))
    assert roomy.swa_full and any("swa_full" in r for r in roomy.reasons)
    base = tune(gemma, h200(24), Request(n_ctx=8192))
    assert not base.swa_full  # no chat template: nothing to reuse across turns
    no_window = tune(read_shape(smollm2_gguf), h200(24), Request(n_ctx=8192))
    assert not no_window.swa_full


def test_a_quantized_cache_is_priced_with_the_attention_kernel_that_runs(shapes, monkeypatch):
    """Patch 0007: one token's attention over a quantized cache walks each KV head's cells once
    for the query heads it serves (8 a block for Qwen3-30B-A3B, 2 for the Qwen3.5-27B shape's
    6, none for dense-27b's 5); runs recorded before it price with the per-head kernel."""
    from localllm.planner import speed
    from localllm.planner.costs import model_costs

    moe, hybrid, dense = (model_costs(shapes[n]) for n in ("qwen3-30b-a3b", "qwen35-27b",
                                                             "dense-27b"))
    block = next(i for i, k in enumerate(moe.kv_k_elements) if k)
    assert speed.heads_per_block(moe, block) == 8
    assert speed.heads_per_block(hybrid, next(i for i, k in enumerate(hybrid.kv_k_elements)
                                              if k)) == 2
    assert speed.heads_per_block(dense, 0) == 1
    monkeypatch.setattr(speed, "GPU_GROUPED_WALK_SHARE", {"q8_0": 0.8})
    card = h200(12)

    def at_16k(costs, kv: str, grouped: bool) -> float:
        return sum(speed.attention_row(costs, kv, kv, 16384, True, card, 16, grouped=grouped))

    # 1 - 0.8 + 0.8 / 8 of the per-head price, where the cache is quantized and heads group
    assert at_16k(moe, "q8_0", True) == pytest.approx(0.3 * at_16k(moe, "q8_0", False), rel=0.02)
    assert at_16k(moe, "f16", True) == at_16k(moe, "f16", False)
    assert at_16k(dense, "q8_0", True) == at_16k(dense, "q8_0", False)
