"""Issue 65, plans checked against what they serve: each answer's decode against the running
plan's predicted curve; a plan more than 15% off has its error laid on the price it belongs to
(the host's seconds, or the GPU's reads of missed experts), stored for this machine and priced
into the next plan, made between requests once the model is idle: loaded again where the new
plan differs, kept where it does not. Real tuner searches over a synthetic Qwen3-30B-A3B
header on an H100 profile as this machine's probe would give it, and a real scheduler with
real llama.cpp runners of SmolLM2."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from runner_answer import answer
from h100_here import h100_here, qwen3_header

from localllm.config import Config
from localllm.daemon.scheduler import Planner, Scheduler
from localllm.options import LoadOptions
from localllm.planner.card import load_card
from localllm.planner.costs import model_costs
from localllm.planner.plan import Plan, cpu_plan
from localllm.planner.search import Request
from localllm.planner.speed import predict_speed
from localllm.planner.tuner import tune
from localllm.profiles.calibration import calibrated, load_calibration
from localllm.profiles.choose import placement_of, settings_of
from localllm.profiles.host_prices import prices_of
from localllm.profiles.served import (
    MIN_CHECK_TOKENS,
    DecodeCheck,
    decode_at,
    drained,
    has_host_part,
)
from localllm.profiles.served_speed import blame, store

CURVE = ((0, 100.0), (1000, 50.0))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_header(tmp_path_factory.mktemp("moe"))


def test_a_check_weighs_each_answer_against_the_curve_at_its_depth():
    assert decode_at(CURVE, 500) == 75.0 and decode_at(CURVE, 5000) == 50.0
    check = DecodeCheck(Plan(4096, predicted_decode_by_depth=CURVE))
    check.add(prompt_tokens=0, eval_count=64, eval_seconds=64 / 70)  # middle depth 32: 98.4
    check.add(prompt_tokens=968, eval_count=64, eval_seconds=64 / 35)  # depth 1000: 50
    assert check.tokens == 128 and check.measured_tps == pytest.approx(128 / (64 / 70 + 64 / 35))
    assert check.predicted_tps == pytest.approx(128 / (64 / 98.4 + 64 / 50))
    assert check.ratio == pytest.approx((64 / 70 + 64 / 35) / (64 / 98.4 + 64 / 50))
    assert check.depth == (32 + 1000) // 2
    assert check.off().startswith(f"it decoded {check.measured_tps:.1f} tok/s over 128 tokens "
                                  f"where its plan predicted {check.predicted_tps:.1f}")
    assert check.off().endswith("slower)")


def test_a_check_judges_only_enough_tokens_and_only_past_the_gap():
    check = DecodeCheck(Plan(4096, predicted_decode_by_depth=CURVE))
    check.add(0, 4, 4 / 50)  # too short an answer to time decode: left out
    assert check.tokens == 0
    check.add(0, MIN_CHECK_TOKENS - 8, (MIN_CHECK_TOKENS - 8) / 50)
    assert check.off() == ""  # half as fast, but too few tokens yet
    check.add(0, 8, 8 / 50)
    assert "slower" in check.off()
    close = DecodeCheck(Plan(4096, predicted_decode_by_depth=CURVE))
    close.add(0, MIN_CHECK_TOKENS, MIN_CHECK_TOKENS / 90)  # 9% under the curve: as priced
    assert close.off() == ""
    fast = DecodeCheck(Plan(4096, predicted_decode_by_depth=CURVE))
    fast.add(0, MIN_CHECK_TOKENS, MIN_CHECK_TOKENS / 130)
    assert "faster" in fast.off()


def test_only_gpu_plans_with_work_on_the_host_are_priced_again():
    assert not has_host_part(Plan(4096, n_gpu_layers=0), 48)  # the CPU's alone: no other way
    assert not has_host_part(Plan(4096, n_gpu_layers=49), 48)  # every weight on the GPU
    assert has_host_part(Plan(4096, n_gpu_layers=30), 48)
    assert has_host_part(Plan(4096, n_gpu_layers=49, tensor_overrides=("experts",)), 48)


def served(plan: Plan, depth: int, tps: float) -> DecodeCheck:
    """A check of `plan` that measured `tps` over 128 tokens at `depth`."""
    check = DecodeCheck(plan)
    check.add(depth - 64, 128, 128 / tps)
    return check


def decode_of(plan: Plan, shape, card, depth: int) -> float:
    return predict_speed(model_costs(shape), placement_of(plan, shape), settings_of(plan), card,
                         plan.n_threads, depth).decode_tps


def test_a_slow_host_is_priced_from_what_it_served(qwen3):
    """Experts in RAM decoding 30% under the price: the error goes on the host's seconds, and
    the same plan priced with the factor predicts what was measured."""
    card = h100_here()
    plan = tune(qwen3, card, Request(n_ctx=32768, expert_cache=0))
    assert plan.tensor_overrides and has_host_part(plan, qwen3.n_layer)
    priced = decode_of(plan, qwen3, card, 1024)
    check = served(plan, 1024, priced * 0.7)
    assert 0.65 < check.measured_tps / check.predicted_tps < 0.75
    field, factor = blame(check, qwen3, card)
    assert field == "served_host_factor" and factor > 1.3
    repriced = decode_of(plan, qwen3, replace(card, served_host_factor=factor), 1024)
    assert repriced == pytest.approx(check.measured_tps * check.predicted_tps / priced, rel=0.03)
    # A host that served faster than priced lowers the factor; a factor in use already is
    # replaced by what the measurement says, not multiplied by it.
    _, lower = blame(served(plan, 1024, priced * 1.25), qwen3, card)
    assert lower < 1.0
    _, again = blame(check, qwen3, replace(card, served_host_factor=2.0))
    assert again == pytest.approx(factor, rel=0.01)


def test_a_pool_whose_misses_the_gpu_reads_is_priced_on_those_reads(qwen3):
    card = h100_here()
    plan = tune(qwen3, card, Request(n_ctx=32768, expert_cache=1024, expert_misses="gpu"))
    assert plan.expert_cache and plan.expert_misses_on_gpu
    check = served(plan, 1024, plan.predicted_decode_by_depth[0][1] * 0.63)
    field, factor = blame(check, qwen3, card)
    assert field == "served_mapped_factor" and factor > 1.3


def test_every_weight_on_the_gpu_has_no_host_price_to_correct(qwen3):
    card = replace(load_card("h100"), source="probe")
    plan = tune(qwen3, card, Request(n_ctx=4096))
    assert plan.n_gpu_layers > qwen3.n_layer and not plan.tensor_overrides
    assert blame(served(plan, 1024, 10.0), qwen3, card) is None


def test_the_next_plan_is_priced_with_the_factor_and_chooses_by_it(qwen3, tmp_path):
    """Stored for this machine (a probed card with a GPU), read back by every later plan, named
    as measured in `tune --json`'s prices; the tuner's choice under it decodes at least as
    fast, under that price, as the old choice did."""
    path = tmp_path / "calibration.toml"
    store("served_host_factor", 1.6, "qwen3:latest", path)
    card = calibrated(h100_here(), path)
    assert card.served_host_factor == 1.6 and card.served_mapped_factor == 1.0
    assert calibrated(load_card("h100"), path).served_host_factor == 1.0  # a profile's box
    prices = prices_of(card, path)
    assert prices["served_host_factor"]["value"] == 1.6
    assert prices["served_host_factor"]["source"].startswith("measured serving qwen3:latest at ")
    assert prices["served_mapped_factor"]["source"].startswith("assumed")
    before = tune(qwen3, h100_here(), Request(n_ctx=32768))
    after = tune(qwen3, card, Request(n_ctx=32768))
    assert decode_of(after, qwen3, card, 1024) >= decode_of(before, qwen3, card, 1024) * 0.99
    assert after.predicted_decode_tps < before.predicted_decode_tps


# ---- the scheduler: checked answers, a re-plan between requests, kept or loaded again --------
FAST = 50_000.0  # tok/s: no CPU decodes SmolLM2 this fast, so every answer is far off


class PricedFast(Planner):
    """A plan with a layer "on the GPU" (a CPU build of llama.cpp runs it on the CPU) priced far
    too fast, on one thread (a runner cannot take fewer on a busy machine, which would leave
    its answers out of the check); `changes`: whether the plan made again differs from the
    first (another batch size), else only its price does."""

    def __init__(self, changes: bool):
        super().__init__()
        self.changes = changes
        self.made = 0

    def choose(self, shape, model_name, n_ctx, options, draft_shape=None, hint=None):
        self.made += 1
        plan = cpu_plan(n_ctx or 1024, shape.context_length)
        batch = 256 if self.made > 1 and self.changes else plan.n_batch
        speed = FAST if self.made == 1 else FAST / 1000
        return replace(plan, n_gpu_layers=1, n_threads=1, n_batch=batch, n_ubatch=batch,
                       predicted_decode_by_depth=((0, speed), (plan.n_ctx, speed)))


@pytest.mark.parametrize("changes", [False, True])
async def test_a_plan_far_from_its_price_is_planned_again_once_idle(
        store, smollm2_gguf, tmp_path, changes):
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    name = str(entry.name)
    planner = PricedFast(changes)
    scheduler = Scheduler(store, Config(), tmp_path / "logs", planner)
    scheduler.replan_idle_s = 3600.0
    await scheduler.start()
    load = LoadOptions(num_ctx=1024)
    try:
        first = None
        for _ in range(MIN_CHECK_TOKENS // 48 + 1):
            async with scheduler.use(entry, load) as runner:
                first = first or runner
                assert runner is first
                await answer(runner)
        model = scheduler.models[name]
        assert model.speed.tokens >= MIN_CHECK_TOKENS
        # said at the answer that made MIN_CHECK_TOKENS; its follow-ups are added since
        assert model.replan.startswith("it decoded ") and model.replan.endswith("x slower)")
        assert model.speed.off().endswith("x slower)")
        await drained()  # the host factor, written off the event loop
        # laid on the host: the price the speed model gives this plan here, made to match what
        # was measured (this fake plan's curve is not that price, so either way of 1)
        host = load_calibration()["host"]
        assert host["served_measured_on"] == name and host["served_host_factor"] != 1.0
        async with scheduler.use(entry, load) as runner:  # a follow-up: the running plan
            assert runner is first and planner.made == 1
        scheduler.replan_idle_s = 0.0
        scheduler._wake.set()
        deadline = time.monotonic() + 120
        def replanned() -> bool:
            model = scheduler.models.get(name)  # none while a new plan loads
            return planner.made >= 2 and model is not None and not model.replan_now \
                and (model.runner is not first or not changes)

        while not replanned():
            assert time.monotonic() < deadline, "not planned again once idle"
            await asyncio.sleep(0.05)  # ok-sleep: polls the reaper's re-plan with a deadline
        model = scheduler.models[name]
        assert not model.replan
        if changes:  # another plan: loaded, the old runner stopped
            assert model.runner is not first and not first.alive
            assert model.runner.running_plan.n_batch == 256
        else:  # the same plan at a new price: kept, its check started over at that price
            assert model.runner is first and first.alive
            assert model.runner.running_plan.predicted_decode_by_depth[0][1] == FAST / 1000
            async with scheduler.use(entry, load) as runner:
                done = await answer(runner)
            assert model.speed.plan is model.runner.running_plan  # checked at the new price
            assert model.speed.tokens == done.eval_count
        assert scheduler._replans[name] == 1
    finally:
        await scheduler.close()
