"""Issue 65, ways chosen by measurement: where `auto` prices an MoE model's ways (no pool, a pool
with its misses on the CPU, or on the GPU) too close to trust, the one its prices pick runs
first, each other is measured serving in turn, and the fastest measured is kept. Real tuner
searches over a synthetic Qwen3-30B-A3B header on an H100 at 12 GiB as this machine's probe
would give it; a real scheduler with real llama.cpp runners of SmolLM2 for the daemon's part."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import replace

import pytest
from runner_answer import answer
from h100_here import h100_here, qwen3_header

from localllm.config import Config
from localllm.daemon.scheduler import Planner, Scheduler
from localllm.modelstore.shape import read_shape
from localllm.options import LoadOptions
from localllm.planner import ways
from localllm.planner.card import load_card
from localllm.planner.expert_pool import AUTO_SLOTS
from localllm.planner.plan import Plan, cpu_plan
from localllm.planner.search import Request
from localllm.planner.tuner import tune
from localllm.profiles.served import drained
from localllm.profiles.ways import measured_ways, record, ways_file


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return qwen3_header(tmp_path_factory.mktemp("moe"))


def auto(**measured) -> Request:
    return Request(n_ctx=32768, expert_cache=AUTO_SLOTS, **measured)


def test_ways_priced_close_are_measured_in_turn_and_the_fastest_measured_kept(qwen3):
    card = h100_here()
    first = tune(qwen3, card, auto())
    names = [w for w, _, _ in first.ways]
    # the H100's three ways are priced within DOUBT of each other: all three are in doubt,
    # none measured yet, and the one the prices pick runs first
    assert sorted(names) == ["no-pool", "pool-cpu", "pool-gpu"]
    assert all(measured == 0 for _, _, measured in first.ways)
    assert first.way in names
    assert first.ways_key == ways.situation(card, auto().margin_bytes, first.n_ctx,
                                            first.n_threads)
    assert any(r.startswith("ways: ways priced too close") for r in first.reasons)
    assert first.way == ways.way_of(first)

    # the first way measured: the unmeasured way priced fastest runs next
    seen = {first.ways_key: {first.way: 89.0}}
    second = tune(qwen3, card, auto(measured_ways=seen))
    unmeasured = [(p, w) for w, p, _ in first.ways if w != first.way]
    assert second.way == max(unmeasured)[1] and second.way == ways.way_of(second)
    assert dict((w, m) for w, _, m in second.ways)[first.way] == 89.0

    # every way measured: the fastest measured is kept, whatever the prices say, and its plan
    # runs that way (the H100 lease's figures: the pool with GPU misses 89, the others 116)
    measured = {"pool-gpu": 89.0, "pool-cpu": 116.0, "no-pool": 116.6}
    kept = tune(qwen3, card, auto(measured_ways={first.ways_key: measured}))
    assert kept.way == "no-pool" and kept.expert_cache == 0
    assert any("the fastest kept" in r for r in kept.reasons)
    measured["pool-cpu"] = 130.0
    kept = tune(qwen3, card, auto(measured_ways={first.ways_key: measured}))
    assert kept.way == "pool-cpu" and kept.expert_cache > 0 and not kept.expert_misses_on_gpu
    # measured under another budget: not this one's
    elsewhere = tune(qwen3, h100_here().with_vram(16), auto(measured_ways={first.ways_key:
                                                                          measured}))
    assert elsewhere.ways_key != first.ways_key
    assert all(m == 0 for _, _, m in elsewhere.ways)


def test_only_auto_weighs_ways(qwen3):
    """A way the user set is not second-guessed: the pool off, or its misses' side set."""
    card = h100_here()
    assert not tune(qwen3, card, Request(n_ctx=32768, expert_cache=0)).ways
    fixed = tune(qwen3, card, Request(n_ctx=32768, expert_cache=AUTO_SLOTS,
                                      expert_misses="cpu"))
    assert {w for w, _, _ in fixed.ways} <= {"no-pool", "pool-cpu"}
    # every expert on the GPU (the whole H100): nothing in RAM, one way
    whole = replace(load_card("h100"), source="probe")
    assert not tune(qwen3, whole, Request(n_ctx=4096, expert_cache=AUTO_SLOTS)).ways


def test_after_measuring_says_what_comes_next():
    table = (("pool-gpu", 122.0, 0.0), ("pool-cpu", 80.0, 0.0), ("no-pool", 70.0, 0.0))
    plan = Plan(4096, way="pool-gpu", ways=table)
    assert ways.after_measuring(plan, 89.0).endswith("is measured next")
    done = (("pool-gpu", 122.0, 0.0), ("pool-cpu", 80.0, 116.0), ("no-pool", 70.0, 100.0))
    assert "that way is loaded" in ways.after_measuring(replace(plan, ways=done), 89.0)
    assert ways.after_measuring(replace(plan, ways=done), 114.0) == ""  # within noise
    assert ways.after_measuring(Plan(4096, way="no-pool"), 50.0) == ""  # nothing weighed


def test_the_record_reads_back_per_model_file_and_situation(tmp_path):
    path = tmp_path / "ways.toml"
    record("qwen3:latest", 1000, "h100, 12 GiB, ctx 32768", "pool-gpu", 89.04, 128, path)
    record("qwen3:latest", 1000, "h100, 12 GiB, ctx 32768", "no-pool", 116.6, 128, path)
    record("qwen3:latest", 1000, "h100, 12 GiB, ctx 32768", "pool-gpu", 91.0, 256, path)
    assert measured_ways("qwen3:latest", 1000, path) == {
        "h100, 12 GiB, ctx 32768": {"pool-gpu": 91.0, "no-pool": 116.6}}
    assert measured_ways("qwen3:latest", 999, path) == {}  # other weights of that name
    assert os.stat(path).st_mode & 0o777 == 0o600
    path.write_text("qwen3 = [broken")
    assert measured_ways("qwen3:latest", 1000, path) == {}


# ---- the daemon: a way measured serving, the next way loaded once idle ---------------------
class TwoWays(Planner):
    """Two ways for SmolLM2 (another batch size each, so each is its own load), priced close,
    chosen with the real planner.ways.choose from what the daemon measured and stored; each
    decodes with `threads`."""

    def __init__(self, threads: int = 1):
        super().__init__()
        self.made: list[str] = []
        self.threads = threads

    def choose(self, shape, model_name, n_ctx, options, draft_shape=None, hint=None):
        base = replace(cpu_plan(n_ctx or 1024, shape.context_length), n_threads=self.threads)
        priced = {way: replace(base, n_batch=batch, n_ubatch=batch, predicted_decode_tps=tps,
                               predicted_decode_by_depth=((0, tps), (base.n_ctx, tps)))
                  for way, batch, tps in (("pool-gpu", 512, 900.0), ("no-pool", 256, 800.0))}
        key = f"test, ctx {base.n_ctx}"
        seen = measured_ways(model_name, shape.file_size).get(key, {})  # as config_request
        way, _, table = ways.choose(priced, "pool-gpu", seen)
        self.made.append(way)
        return replace(priced[way], way=way, ways=table, ways_key=key)


async def _serve_until_both_measured(store, smollm2_gguf, tmp_path, planner: TwoWays,
                                     threads_dropped: bool = False) -> None:
    """Answers until the daemon has measured both ways; then the kept way is the fastest
    measured. `threads_dropped`: every answer runs with a thread less than its plan (as the
    runner's thread trials leave it on a busy host)."""
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    name, size = str(entry.name), read_shape(smollm2_gguf).file_size
    scheduler = Scheduler(store, Config(), tmp_path / "logs", planner)
    scheduler.replan_idle_s = 0.0
    await scheduler.start()
    load = LoadOptions(num_ctx=1024)
    try:
        deadline = time.monotonic() + 240
        while len(measured_ways(name, size).get("test, ctx 1024", {})) < 2:
            assert time.monotonic() < deadline, (planner.made, measured_ways(name, size))
            async with scheduler.use(entry, load) as runner:
                if threads_dropped:
                    runner.n_threads = runner.running_plan.n_threads - 1
                await answer(runner)
            await drained()
        # the priced way first, then the other; a third plan only for a way measured faster
        assert planner.made[:2] == ["pool-gpu", "no-pool"]
        measured = measured_ways(name, size)["test, ctx 1024"]
        assert all(tps > 0 for tps in measured.values()) and ways_file().exists()
        while scheduler.models.get(name) is None or scheduler.models[name].replan:
            assert time.monotonic() < deadline, "the last re-plan did not end"
            await asyncio.sleep(0.05)  # ok-sleep: polls the reaper's re-plan with a deadline
        model = scheduler.models[name]
        fastest = max(measured, key=measured.get)
        assert model.runner.running_plan.way == fastest or \
            measured[model.runner.running_plan.way] * ways.WORTH_A_RELOAD >= measured[fastest]
        assert len(planner.made) <= 3
        if threads_dropped:  # measured as the way serves; no price corrected from it
            assert model.speed is None or model.speed.tokens == 0
    finally:
        await scheduler.close()


async def test_the_daemon_measures_each_way_in_turn(store, smollm2_gguf, tmp_path):
    await _serve_until_both_measured(store, smollm2_gguf, tmp_path, TwoWays())


async def test_a_way_is_measured_at_the_threads_the_runner_kept(store, smollm2_gguf, tmp_path):
    # Lease F: the runner tried 15 of a plan's 16 threads after each slow answer, and the
    # way in trial, never measured at its own threads, ran eleven answers without end.
    await _serve_until_both_measured(store, smollm2_gguf, tmp_path, TwoWays(threads=2),
                                     threads_dropped=True)


def test_each_band_of_a_runner_has_its_way_trials():
    from localllm.daemon.replanning import MAX_REPLANS, way_trial_allowed

    # An H100 lease's banded runner: after the price corrections, the 8K band measured its
    # other two ways and went back to the fastest (three re-plans), then the 32K band measured
    # its other two; the third, back to its fastest (the pool, 61 tok/s where the last way
    # measured did 41), must still be allowed.
    replans = MAX_REPLANS + 5
    assert way_trial_allowed(replans, n_plans=2)
    assert not way_trial_allowed(replans + 1, n_plans=2)
    assert not way_trial_allowed(MAX_REPLANS + 3, n_plans=1)  # one plan: three trials
