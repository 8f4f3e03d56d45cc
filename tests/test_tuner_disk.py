"""Plans past RAM: weights beyond VRAM plus the RAM budget stay mmapped and are read from disk
per token; the plan says how much and at what rate, and predicts decode with it."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import synth_gguf

from localllm.modelstore.shape import read_shape
from localllm.profiles.card import GIB, load_card
from localllm.profiles.disk import ASSUMED_DISK_GBS
from localllm.profiles.tuner import Request, ram_budget, tune, vram_budget


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return read_shape(paths["70b"])  # 37 GiB of Q4_0 weights


def disk_lines(plan) -> list[str]:
    return [r for r in plan.reasons if "read from disk per token" in r]


def test_weights_past_ram_are_read_from_disk_and_cost_speed(big):
    small = load_card("rtx3060-12g").with_host(16 * GIB, 8, 40.0)
    roomy = load_card("rtx3060-12g").with_host(64 * GIB, 8, 40.0)
    request = Request(n_ctx=4096)
    spilled, in_ram = tune(big, small, request), tune(big, roomy, request)

    assert not disk_lines(in_ram)
    [line] = disk_lines(spilled)
    assert f"at {ASSUMED_DISK_GBS:.1f} GB/s (assumed)" in line
    # The figure is the CPU's weights beyond what the RAM budget leaves after KV and buffers.
    cpu = next(m for m in spilled.memory if m.device == "CPU")
    excess = cpu.total - ram_budget(small)
    assert excess > 0 and line.startswith(f"{excess / GIB:.1f} GiB read from disk")
    assert spilled.use_mmap
    assert spilled.predicted_decode_tps < in_ram.predicted_decode_tps
    # Reading the excess at the assumed rate alone bounds the speed from above.
    assert spilled.predicted_decode_tps < ASSUMED_DISK_GBS * 1e9 / excess
    for plan, card in ((spilled, small), (in_ram, roomy)):
        for m in plan.memory:
            if m.device != "CPU":
                assert m.total <= vram_budget(card, request.margin_bytes)


def test_a_measured_disk_rate_is_used_and_named(big):
    assumed = load_card("rtx3060-12g").with_host(16 * GIB, 8, 40.0)
    fast = replace(assumed, disk_read_gbs=6.5)
    slow_plan, fast_plan = tune(big, assumed, Request(n_ctx=4096)), tune(big, fast,
                                                                         Request(n_ctx=4096))
    [line] = disk_lines(fast_plan)
    assert "at 6.5 GB/s (measured by tune --calibrate)" in line
    assert fast_plan.predicted_decode_tps > slow_plan.predicted_decode_tps


def test_cpu_only_host_smaller_than_the_model(big):
    cpu = load_card("cpu-only").with_host(24 * GIB, 8, 40.0)
    plan = tune(big, cpu, Request(n_ctx=4096))
    [line] = disk_lines(plan)
    gib_read = float(re.match(r"([\d.]+) GiB", line).group(1))
    assert 37.0 - 24 < gib_read < 37.0  # more than the model's excess over RAM, less than all
    assert plan.n_gpu_layers == 0 and plan.predicted_decode_tps < 1.0


def test_more_ram_is_never_slower(big):
    speeds = [tune(big, load_card("rtx3060-12g").with_host(ram * GIB, 8, 40.0),
                   Request(n_ctx=4096)).predicted_decode_tps for ram in (12, 16, 24, 32, 48, 64)]
    assert speeds == sorted(speeds)
    assert speeds[0] < speeds[-1]
