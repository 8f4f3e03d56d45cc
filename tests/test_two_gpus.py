"""Several local GPUs: profiles of two-card boxes, the tuner's split by layer with the exact
memory of each GPU, a slow card left out, the probe restricted by CUDA_VISIBLE_DEVICES and the
gpus setting, tensor_split reaching llama.cpp's model params, and the split in ps. No GPU is
needed: the cards are profiles (a 70B-class header-only model planned for them)."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import llama_cpp
import pytest
from scripts import synth_gguf
from localllm.daemon.api.ollama import device_split
from localllm.engine.local import runner_env
from localllm.engine import dryrun
from localllm.engine.hardware import card_from_nvml, visible_devices
from localllm.engine.params import model_params
from localllm.modelstore.shape import read_shape
from localllm.planner.budgets import vram_budgets
from localllm.planner.card import GIB, MIB, CardError, load_card
from localllm.planner.memory import split_layers
from localllm.planner.plan import Plan
from localllm.engine.probes import Worker, WorkerDevice
from localllm.planner.search import Request
from localllm.planner.tuner import tune
from localllm.profiles.rpc_plan import plan_with_workers

from localllm.config import ConfigError, load_config

KV_BYTES = {"f16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18)}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return {name: read_shape(paths[name]) for name in ("70b", "llama-8b", "llama-1b")}


def expected_bytes(config: synth_gguf.ShapeConfig, plan: Plan) -> dict[str, list[int]]:
    """{device: [weights, kv]} from the generator's tensor table, placed as llama.cpp does with
    a tensor_split of layer counts: the first layers on the CPU, then a run per device in the
    order of device_layers, the output layer (lm-head, final norm) the last layer, token_embd
    on the CPU, override patterns by regex search."""
    owner = []
    for device, count in plan.device_layers:
        owner += [device] * count
    assert len(owner) == config.n_layer + 1
    out = {device: [0, 0] for device, _ in plan.device_layers}
    quant = synth_gguf.GGMLQuantizationType["Q4_0"]

    def place(name: str, device: str, nbytes: int) -> None:
        for o in plan.tensor_overrides:
            if re.search(o.pattern, name):
                device = o.device
        out[device][0] += nbytes

    for name, dims in synth_gguf.tensor_table(config):
        nbytes = synth_gguf.tensor_bytes(dims, synth_gguf.tensor_type(name, dims, quant))
        m = re.match(r"blk\.(\d+)\.", name)
        if m:
            place(name, owner[int(m.group(1))], nbytes)
        elif name == "token_embd.weight":
            out["CPU"][0] += nbytes
        else:
            place(name, owner[-1], nbytes)
    block_k, block_bytes = KV_BYTES[plan.type_k]
    row = config.n_head_kv * config.head_dim // block_k * block_bytes
    for i in range(config.n_layer):
        out[owner[i]][1] += (plan.n_ctx + 255) // 256 * 256 * row * 2 * plan.n_parallel
    return out


def test_two_card_profiles_describe_a_box_of_two():
    for name, gib in (("2x-rtx3090", 24), ("2x-rtx3060-12g", 12)):
        card = load_card(name)
        assert card.n_gpus == 2 and card.devices == ("CUDA0", "CUDA1")
        assert [g.vram_bytes for g in card.gpu_list] == [gib * GIB] * 2
        assert card.label.startswith("2 x ") and all("2 x" not in g.label for g in card.gpu_list)
        emulated = card.with_vram(10)
        assert [g.free_vram_bytes for g in emulated.gpu_list] == [10 * GIB] * 2
    mixed = load_card("rtx3090+rtx3060-12g")
    assert [(g.device, g.vram_bytes, g.bandwidth_gbs) for g in mixed.gpu_list] == [
        ("CUDA0", 24 * GIB, 936), ("CUDA1", 12 * GIB, 360)]
    with pytest.raises(CardError, match="unknown card 'gtx-9999'"):
        load_card("rtx3090+gtx-9999")


def test_split_layers_keeps_each_device_in_its_room():
    assert split_layers([10] * 10, [100, 100], [1, 1]) == (5, 5)
    assert split_layers([10] * 10, [30, 100], [1, 1]) == (3, 7)  # the first is full at 3
    assert split_layers([10] * 10, [100, 100], [1, 0]) == (10, 0)  # a device left out
    assert split_layers([10] * 10, [100, 100], [1, 1e6]) == (0, 10)  # the fast one first
    assert split_layers([10] * 10, [40, 50], [1, 1]) is None  # 100 bytes do not fit 90


@pytest.mark.parametrize("name,ctx", [("2x-rtx3090", 8192), ("2x-rtx3060-12g", 8192),
                                      ("2x-rtx3090", 32768)])
def test_70b_over_two_cards_has_exact_memory_on_each(shapes, name, ctx):
    card = load_card(name)
    plan = tune(shapes["70b"], card, Request(n_ctx=ctx))
    layers = dict(plan.device_layers)
    assert list(layers) == ["CPU", "CUDA0", "CUDA1"]
    assert layers["CUDA0"] > 0 and layers["CUDA1"] > 0
    assert plan.tensor_split == (float(layers["CUDA0"]), float(layers["CUDA1"]))
    assert plan.n_gpu_layers == layers["CUDA0"] + layers["CUDA1"]
    memory = {m.device: m for m in plan.memory}
    budgets = vram_budgets(card, 512 * MIB)
    want = expected_bytes(synth_gguf.SHAPES["70b"], plan)
    config = synth_gguf.SHAPES["70b"]
    # each GPU: the CUDA context, its own pool of kernel temporaries (the q8_1 copy of a
    # micro-batch's widest input, and stream-k's fixup tiles), and its page tables of the RAM
    # weights registered with CUDA where blocks or tensors stay in RAM (8 bytes per 4 KiB page)
    pool = int(plan.n_ubatch * max(config.n_embd, config.n_ff) * 36 / 32) + 9 * MIB
    in_ram = layers["CPU"] > 0 or bool(plan.tensor_overrides)
    tables = int(want["CPU"][0] * 8 / 4096) if in_ram else 0
    for device in ("CUDA0", "CUDA1"):
        assert memory[device].total <= budgets[device], device
        assert memory[device].overhead == card.overhead_bytes + pool + tables
    for device in ("CUDA0", "CUDA1", "CPU"):
        assert memory[device].weights == want[device][0], device
        assert memory[device].kv == want[device][1], device
    assert any(r.startswith("split over the GPUs by layer") for r in plan.reasons)
    if name == "2x-rtx3090":  # 37 GiB of weights fit in two 24 GB cards
        assert layers["CPU"] == 0 and not plan.tensor_overrides


def test_two_cards_are_faster_than_one_and_ram(shapes):
    shape, request = shapes["70b"], Request(n_ctx=8192)
    two = tune(shape, load_card("2x-rtx3090"), request)
    one = tune(shape, load_card("rtx3090").with_host(128 * GIB, 16, 60.0), request)
    assert two.predicted_decode_tps > 2 * one.predicted_decode_tps
    assert two.predicted_prefill_tps > one.predicted_prefill_tps


def test_a_slow_card_is_left_out_when_the_fast_one_holds_the_model(shapes):
    card = load_card("rtx3090+rtx3060-12g")
    plan = tune(shapes["llama-8b"], card, Request(n_ctx=8192))
    assert dict(plan.device_layers)["CUDA1"] == 0
    assert plan.tensor_split[1] == 0 and plan.n_gpu_layers == plan.tensor_split[0]
    (line,) = [r for r in plan.reasons if "left out" in r]
    assert line.startswith("CUDA1 (NVIDIA GeForce RTX 3060 12GB, 360 GB/s) left out: the best "
                           "plan using every GPU takes")
    # The 70B does not fit the 3090: both cards take layers, the fast one more of them.
    big = tune(shapes["70b"], card, Request(n_ctx=8192))
    layers = dict(big.device_layers)
    assert layers["CUDA0"] > layers["CUDA1"] > 0
    memory = {m.device: m.total for m in big.memory}
    budgets = vram_budgets(card, 512 * MIB)
    assert memory["CUDA0"] <= budgets["CUDA0"] and memory["CUDA1"] <= budgets["CUDA1"]


NVML = [{"name": "NVIDIA GeForce RTX 3090", "total": 24 * GIB, "free": 23 * GIB, "index": 0,
         "uuid": "GPU-aaaa-1111"},
        {"name": "NVIDIA GeForce RTX 3060", "total": 12 * GIB, "free": 11 * GIB, "index": 1,
         "uuid": "GPU-bbbb-2222"}]


def test_cuda_visible_devices_and_the_gpus_setting_restrict_the_probe(shapes):
    assert [d["index"] for d in visible_devices(NVML)] == [0, 1]
    assert [d["index"] for d in visible_devices(NVML, "1")] == [1]
    assert [d["index"] for d in visible_devices(NVML, "1,0")] == [1, 0]
    assert visible_devices(NVML, "") == [] and visible_devices(NVML, "-1") == []
    assert [d["index"] for d in visible_devices(NVML, "0,junk,1")] == [0]  # CUDA stops there
    assert [d["index"] for d in visible_devices(NVML, "GPU-bbbb")] == [1]
    assert [d["index"] for d in visible_devices(NVML, None, "1")] == [1]
    assert visible_devices(NVML, "0", "1") == []
    both = card_from_nvml(NVML, 64 * GIB, 12)
    assert [(g.device, g.index, g.free_vram_bytes, g.bandwidth_gbs) for g in both.gpu_list] == [
        ("CUDA0", 0, 23 * GIB, 936), ("CUDA1", 1, 11 * GIB, 360)]
    # room kept on the first GPU (a vision projector) is taken from that GPU's own figures
    kept = both.less_vram(GIB)
    assert [g.free_vram_bytes for g in kept.gpu_list] == [22 * GIB, 11 * GIB]
    assert kept.free_vram_bytes == 11 * GIB
    second = card_from_nvml(visible_devices(NVML, None, "1"), 64 * GIB, 12)
    assert second.name == "rtx3060-12g" and second.devices == ("CUDA0",)
    # A plan for the probed second GPU runs its runner with that GPU alone as CUDA0.
    plan = tune(shapes["llama-1b"], second, Request(n_ctx=4096))
    assert plan.gpus == (1,)
    env = runner_env(plan)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    # a plan from a profile leaves the daemon's own view
    unset = runner_env(replace(plan, gpus=()))
    assert unset.get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpus_setting_from_file_and_env(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("gpus = [0, 2]\n")
    assert load_config(path, {}).gpus == "0,2"
    assert load_config(path, {"LOCALLLM_GPUS": "1"}).gpus == "1"
    assert load_config(tmp_path / "none.toml", {}).gpus == "all"
    path.write_text('max_queue = 4\ngpus = "first"\n')
    with pytest.raises(ConfigError, match=r"config.toml:2: gpus must be all or GPU indices"):
        load_config(path, {})
    with pytest.raises(ConfigError, match="gpus must be all"):
        load_config(tmp_path / "none.toml", {"LOCALLLM_GPUS": "0,0"})


def test_tensor_split_reaches_the_model_params(shapes, smollm2_gguf):
    plan = tune(shapes["70b"], load_card("2x-rtx3090"), Request(n_ctx=8192))
    params, keep = model_params(plan)
    assert params.split_mode == llama_cpp.LLAMA_SPLIT_MODE_LAYER
    assert [params.tensor_split[i] for i in range(3)] == [*plan.tensor_split, 0.0]
    assert params.n_gpu_layers == plan.n_gpu_layers
    # The same kind of plan loads on this machine's CPU build (llama.cpp has no GPU to split
    # over and keeps every layer on the CPU): the split is a valid parameter, not a crash.
    small = tune(read_shape(smollm2_gguf), load_card("2x-rtx3060-12g"), Request(n_ctx=1024))
    assert len(small.tensor_split) == 2 and sum(small.tensor_split) == small.n_gpu_layers
    result = dryrun.run(str(smollm2_gguf), small)
    assert result is not None and result.compute.get("CPU", 0) > 0


def test_ps_shows_each_gpu_with_its_layers_and_memory(shapes):
    plan = tune(shapes["70b"], load_card("2x-rtx3090"), Request(n_ctx=8192))
    rows = device_split(plan)
    assert [r["device"] for r in rows] == ["CPU", "CUDA0", "CUDA1"]
    memory = {m.device: m.total for m in plan.memory}
    assert [r["layers"] for r in rows] == [k for _, k in plan.device_layers]
    assert all(r["size"] == memory[r["device"]] for r in rows)


def test_rpc_plan_keeps_the_local_split_over_two_cards(shapes):
    shape, card = shapes["70b"], load_card("2x-rtx3060-12g")
    request = Request(n_ctx=8192)
    local = tune(shape, card, replace(request, ffn_split=False))
    free = 16 * GIB
    workers = [Worker("a:1", (WorkerDevice("a:1", 0, free, free),), 1.25e9, 2e-4, 0.0)]
    plan = plan_with_workers(shape, card, request, workers, local)
    split = dict(plan.device_layers)
    local_split = dict(local.device_layers)
    assert split["CUDA0"] == local_split["CUDA0"] and split["CUDA1"] == local_split["CUDA1"]
    assert split["RPC[a:1]"] > 0
    assert plan.tensor_split == (split["RPC[a:1]"], split["CUDA0"], split["CUDA1"])
