"""Issue 65, a runner's GPU memory against its plan: what it holds beyond what the plan counted
raises this machine's GPU overhead (calibration.toml's [host]), which every later plan on a
probed card counts. Real tuner searches over a synthetic Qwen3-30B-A3B header on an H100
profile as this machine's probe would give it; the runner's NVML figure is the one input that
cannot exist here, so it is given as a number."""

from __future__ import annotations

import asyncio

import pytest
from h100_here import h100_here, qwen3_header

from localllm.planner.card import MIB, load_card
from localllm.planner.plan import Plan, cpu_plan
from localllm.planner.search import Request
from localllm.planner.tuner import tune
from localllm.profiles.calibration import OVERHEAD_KEY, calibrated, load_calibration
from localllm.profiles.served import ServedRecords, drained
from localllm.profiles.served_vram import overhead_from, planned_gpu_bytes, store


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_header(tmp_path_factory.mktemp("moe"))


def test_what_a_runner_holds_past_its_plan_is_overhead(qwen3):
    card = h100_here()
    plan = tune(qwen3, card, Request(n_ctx=32768))
    planned = planned_gpu_bytes(plan)
    assert planned == next(m.total for m in plan.memory if m.device == "CUDA0") > 0
    assert overhead_from(plan, planned + 200 * MIB, card.overhead_bytes) == \
        card.overhead_bytes + 200 * MIB
    assert overhead_from(plan, planned + MIB, card.overhead_bytes) is None  # NVML's rounding
    assert overhead_from(plan, planned - 300 * MIB, card.overhead_bytes) is None
    assert overhead_from(cpu_plan(4096), 10 << 30, card.overhead_bytes) is None
    assert overhead_from(plan, planned + (20 << 30), card.overhead_bytes) is None  # not sane


def test_a_measured_overhead_is_kept_and_planned_with(qwen3, tmp_path):
    path = tmp_path / "calibration.toml"
    card = h100_here()
    before = tune(qwen3, card, Request(n_ctx=32768))
    raised = card.overhead_bytes + 400 * MIB
    assert store(raised, card.overhead_bytes, path)
    assert not store(raised - MIB, raised, path)  # only ever raised
    assert load_calibration(path)["host"][OVERHEAD_KEY] == raised / MIB
    here = calibrated(card, path)
    assert here.overhead_bytes == raised
    assert calibrated(load_card("h100"), path).overhead_bytes == card.overhead_bytes  # a profile
    after = tune(qwen3, here, Request(n_ctx=32768))
    gpu = {p: next(m for m in p.memory if m.device == "CUDA0") for p in (before, after)}
    # the overhead's 400 MiB, and the page tables of the weights it sends to RAM
    assert 400 * MIB <= gpu[after].overhead - gpu[before].overhead < 402 * MIB
    assert gpu[after].weights < gpu[before].weights  # the room comes out of the weights
    assert gpu[after].total <= card.free_vram_bytes


def test_serving_stores_what_the_runner_held(qwen3, home):
    card = h100_here()
    plan = tune(qwen3, card, Request(n_ctx=32768))
    records = ServedRecords("m", qwen3.file_size)
    records.vram_served(plan, lambda: planned_gpu_bytes(plan) + 150 * MIB, lambda: card)
    records.vram_served(Plan(4096), lambda: None, lambda: card)  # no GPU figure: nothing
    asyncio.run(drained())
    host = load_calibration()["host"]
    assert host[OVERHEAD_KEY] == pytest.approx((card.overhead_bytes + 150 * MIB) / MIB, abs=0.1)
    assert calibrated(card).overhead_bytes == pytest.approx(card.overhead_bytes + 150 * MIB,
                                                            abs=MIB)
