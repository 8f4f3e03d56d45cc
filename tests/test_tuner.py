"""The plan search over every synthetic shape, the 8/12/16/24/80 GiB card profiles and contexts
4096/32768/131072: plans fit, their weight and KV bytes agree with an independent computation
from the generator's tensor table and llama.cpp's placement rules, more VRAM is never slower,
and an impossible request says what would fit."""

from __future__ import annotations

import re

import pytest
from scripts import synth_gguf

from localllm.engine.params import rollback_positions
from localllm.modelstore.shape import read_shape
from localllm.planner.card import GIB, MIB, load_card
from localllm.planner.memory import ComputeTable, ContextSettings
from localllm.planner.placements import Placement
from localllm.planner.budgets import ram_budget, vram_budget
from localllm.planner.search import NoPlanFits, Request
from localllm.planner.tuner import tune

CARDS = {8: "rtx4060", 12: "rtx3060-12g", 16: "rtx4060ti-16g", 24: "rtx3090", 80: "a100-80g"}
CONTEXTS = (4096, 32768, 131072)
HOST = dict(ram_bytes=64 * GIB, cores=8, host_bandwidth_gbs=50.0)
KV_BYTES = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return {name: read_shape(path) for name, path in paths.items()}


def card(gib: int):
    return load_card(CARDS[gib]).with_host(**HOST)


def pad256(n: int) -> int:
    return (n + 255) // 256 * 256


def expected_bytes(config: synth_gguf.ShapeConfig, plan) -> dict[str, list[int]]:
    """{device: [weights, kv]} from the generator's tensor table, placing tensors as llama.cpp
    does: the last n_gpu_layers of blocks + output on the GPU, token_embd on the CPU (and again
    as the lm-head when tied), NextN blocks loaded only for MTP (then with one layer of KV of
    their own: the MTP context's), override patterns by regex search."""
    out = {"CUDA0": [0, 0], "CPU": [0, 0]}
    n_blocks = config.n_layer + config.n_nextn
    start = n_blocks + 1 - min(plan.n_gpu_layers, n_blocks + 1)
    output_device = "CUDA0" if start <= n_blocks else "CPU"
    quant = synth_gguf.GGMLQuantizationType[synth_gguf_type]

    def place(name: str, device: str, nbytes: int) -> None:
        for o in plan.tensor_overrides:
            if re.search(o.pattern, name):
                device = o.device
        out[device][0] += nbytes

    for name, dims in synth_gguf.tensor_table(config):
        ggml_type = synth_gguf.tensor_type(name, dims, quant, config.arch)
        nbytes = synth_gguf.tensor_bytes(dims, ggml_type)
        m = re.match(r"blk\.(\d+)\.", name)
        if m:
            block = int(m.group(1))
            if block >= config.n_layer and plan.speculative != "mtp":
                continue  # NextN: skipped unless MTP is loaded
            place(name, "CUDA0" if block >= start else "CPU", nbytes)
        elif name == "token_embd.weight":
            out["CPU"][0] += nbytes
            if config.tied_embeddings:
                place(name, output_device, nbytes)
        else:
            place(name, output_device, nbytes)
    block_k, block_bytes = KV_BYTES[plan.type_k]
    for i in range(config.n_layer):
        device = "CUDA0" if i >= start else "CPU"
        if config.full_attention_interval and (i + 1) % config.full_attention_interval:
            s = config.ssm
            d_inner = s["d_state"] * s["dt_rank"]
            # llama.cpp keeps 1 + n_rs_seq copies of a recurrent state (snapshots for drafts).
            copies = 1 + rollback_positions(plan)
            out[device][1] += ((s["d_conv"] - 1) * (d_inner + 2 * s["n_group"] * s["d_state"])
                               + s["d_state"] * d_inner) * 4 * copies
            continue
        cells = pad256(plan.n_ctx)
        period = 2 if config.arch == "gpt-oss" else 6  # gpt-oss alternates, gemma3 5 of 6
        if config.sliding_window and i % period < period - 1:
            cells = min(cells, pad256(config.sliding_window + plan.n_ubatch))
        row = config.n_head_kv * config.head_dim // block_k * block_bytes
        out[device][1] += cells * row * 2
    if plan.speculative == "mtp":
        for i in range(config.n_layer, n_blocks):
            row = config.n_head_kv * config.head_dim // block_k * block_bytes
            out["CUDA0" if i >= start else "CPU"][1] += pad256(plan.n_ctx) * row * 2
    return out


synth_gguf_type = "Q4_0"


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("gib", sorted(CARDS))
@pytest.mark.parametrize("name", list(synth_gguf.SHAPES))
def test_plan_fits_and_its_bytes_agree(shapes, name, gib, ctx):
    shape, config, c = shapes[name], synth_gguf.SHAPES[name], card(gib)
    plan = tune(shape, c, Request(n_ctx=ctx))
    assert plan.n_ctx == min(ctx, config.context_length)
    memory = {m.device: m for m in plan.memory}
    assert set(memory) == {"CUDA0", "CPU"}
    assert memory["CUDA0"].total <= vram_budget(c, 512 * MIB)
    assert memory["CPU"].total <= ram_budget(c)
    want = expected_bytes(config, plan)
    # the CUDA context, ggml-cuda's pool of kernel temporaries (the q8_1 copy of a
    # micro-batch's input, gathered once per routed expert, and stream-k's fixup tiles), and
    # the page tables of the RAM weights registered with CUDA where more than the token table
    # stays in RAM: 8 bytes per 4 KiB page
    rows = plan.n_ubatch * max(1, config.n_expert_used)
    width = max(config.n_embd, config.n_ff_expert if config.n_expert else config.n_ff)
    in_ram = any(d == "CPU" and n for d, n in plan.device_layers) or bool(plan.tensor_overrides)
    tables = int(want["CPU"][0] * 8 / 4096) if in_ram else 0
    assert memory["CUDA0"].overhead == (c.overhead_bytes + int(rows * width * 36 / 32) + 9 * MIB
                                        + tables)
    for device in ("CUDA0", "CPU"):
        assert memory[device].weights == want[device][0], device
        assert memory[device].kv == want[device][1], device
    assert plan.type_k == plan.type_v and plan.type_k in KV_BYTES
    assert plan.flash_attn and plan.predicted_decode_tps > 0 and plan.predicted_prefill_tps > 0
    assert plan.reasons and plan.source == "tuner"


@pytest.mark.parametrize("ctx", CONTEXTS)
@pytest.mark.parametrize("name", list(synth_gguf.SHAPES))
def test_more_vram_is_never_slower(shapes, name, ctx):
    """Same card, growing memory, speed first (quality = speed): decode never drops by more
    than the 1% band in which the tuner prefers KV precision to speed. (Under the default,
    balanced, policy more memory may buy precision at a little speed: q4_0 is admitted only
    where q8_0 cannot keep the KV on the GPU.)"""
    base = load_card("rtx3090").with_host(**HOST)
    plans = [tune(shapes[name], base.with_vram(g), Request(n_ctx=ctx, quality="speed"))
             for g in sorted(CARDS)]
    speeds = [p.predicted_decode_tps for p in plans]
    for smaller, larger in zip(speeds, speeds[1:], strict=False):
        assert larger >= smaller * 0.99, speeds


def test_kv_precision_and_placement_follow_the_budget(shapes):
    shape = shapes["dense-27b"]
    roomy = tune(shape, card(80), Request(n_ctx=32768))
    tight = tune(shape, card(12), Request(n_ctx=32768))
    assert roomy.type_k == "f16" and roomy.n_gpu_layers == shape.n_layer + 1
    assert tight.type_k in ("q8_0", "q4_0")
    assert tight.n_gpu_layers < shape.n_layer + 1 or tight.tensor_overrides
    # a whole-block placement is named among the rejected ("46 of 66 blocks on the GPU")
    assert any(r.startswith("rejected: ") and ("whole blocks" in r or re.search(
        r"\d+ of \d+ blocks on the GPU", r)) for r in tight.reasons)


def test_moe_keeps_experts_in_ram_rather_than_whole_blocks(shapes):
    shape = shapes["qwen3-30b-a3b"]
    plan = tune(shape, card(12), Request(n_ctx=32768))
    names = [t.name for t in shape.tensors]
    on_cpu = [n for n in names if any(re.search(o.pattern, n) for o in plan.tensor_overrides)]
    if plan.n_gpu_layers == shape.n_layer + 1:  # the expert placement won
        assert on_cpu and all("_exps" in n for n in on_cpu)
    assert any("experts" in r for r in plan.reasons)  # chosen or named as the alternative


def test_default_context_is_the_largest_that_stays_fast(shapes):
    for name, shape in shapes.items():
        plan = tune(shape, card(24))
        base = tune(shape, card(24), Request(n_ctx=4096))
        assert 4096 <= plan.n_ctx <= shape.context_length
        start, base_start = plan.predicted_decode_by_depth[0], base.predicted_decode_by_depth[0]
        assert start[0] == base_start[0] == 0
        assert start[1] >= 0.9 * base_start[1], name
        ranks = ("f16", "q8_0", "q4_0")
        assert ranks.index(plan.type_k) <= ranks.index(base.type_k), name
        assert any(r.startswith(f"context {plan.n_ctx}:") for r in plan.reasons)


def test_impossible_request_says_what_would_fit(shapes):
    # 8 GiB of RAM: weights past RAM would be read from disk, but the KV cache cannot be.
    six_gib = load_card("rtx4060").with_vram(6).with_host(8 * GIB, 8, 50.0)
    with pytest.raises(NoPlanFits) as e:
        tune(shapes["70b"], six_gib, Request(n_ctx=131072))
    message = str(e.value)
    assert "\n" not in message
    assert "131072" in message and "would fit" in message and "q4_0 KV" in message


def test_model_larger_than_the_machine(shapes):
    # Weights past RAM stay on disk (test_tuner_disk.py); with no RAM to spare beyond what the
    # system keeps, not even the compute buffers fit.
    small = load_card("rtx4060").with_host(2 * GIB, 4, 30.0)
    with pytest.raises(NoPlanFits, match="no context fits"):
        tune(shapes["70b"], small, Request(n_ctx=4096))


def test_cpu_only_plan_matches_cpu_plan_defaults(shapes):
    cpu = load_card("cpu-only")
    plan = tune(shapes["llama-8b"], cpu)
    assert plan.n_gpu_layers == 0 and plan.n_ctx == 4096 and plan.type_k == "f16"
    assert plan.flash_attn and not plan.tensor_overrides  # faster on the CPU too
    assert [m.device for m in plan.memory] == ["CPU"]
    assert plan.n_threads == cpu.cores


def test_forced_gpu_layers_are_honoured(shapes):
    plan = tune(shapes["llama-8b"], card(24), Request(n_ctx=4096, n_gpu_layers=10))
    assert plan.n_gpu_layers == 10


def test_measured_compute_buffer_is_used_exactly(shapes):
    shape, c = shapes["llama-8b"], card(24)
    plan = tune(shape, c, Request(n_ctx=4096))
    settings = ContextSettings(4096, plan.type_k, plan.type_v, True, plan.n_ubatch)
    key = ComputeTable.key(settings, Placement(plan.n_gpu_layers))
    measured = ComputeTable({key: {"CUDA0": 777 * MIB, "CPU": 5 * MIB}})
    again = tune(shape, c, Request(n_ctx=4096), measured)
    memory = {m.device: m for m in again.memory}
    assert memory["CUDA0"].compute == 777 * MIB and memory["CPU"].compute == 5 * MIB


def test_context_below_256_is_refused(shapes):
    with pytest.raises(NoPlanFits, match="too small"):
        tune(shapes["llama-8b"], card(24), Request(n_ctx=100))
