"""Issue 40, the expert cache from the setting to the user: a real daemon with `expert_cache = 16`
plans the pool, its runner creates the model's context with it (in RAM here: the setting
expert_cache_device = cpu, no GPU on this machine), and the figures come back in /api/stats,
/api/ps and `localllm ps`. Real llama.cpp with the patched engine, a tiny synthetic qwen3moe (4
MoE blocks of 32 experts, 4 routed, skewed routing, every weight drawn) in Q4_1, a type
llama.cpp does not repack for the CPU, so that the runs with and without the cache differ in
nothing else."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest
from scripts import synth_gguf
from conftest import import_models
from daemon_process import isolated_env, start_daemon, wait_for
from localllm.daemon.scheduler import Planner, Scheduler
from localllm.engine.local import RunnerProcess
from localllm.engine.runner.protocol import Done, GenerationRequest, SamplingOptions
from localllm.planner.plan import cpu_plan
from localllm.profiles.expert_hits import MIN_LOOKUPS, REPLAN_HIT_GAP, measured_hits
from localllm.profiles.served import drained

from localllm.config import Config
from localllm.options import LoadOptions

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "assistant:")
ASK = {"model": "moe", "stream": False,
       "messages": [{"role": "user", "content": "Name three colours of the sea at dusk."}],
       "options": {"temperature": 0, "num_predict": 40, "seed": 1}}


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    tiny = synth_gguf.tiny(synth_gguf.SHAPES["qwen3-30b-a3b"])
    shape = dataclasses.replace(tiny, name="moe-cache", n_layer=4, n_expert=32, n_expert_used=4)
    # seed 1: greedy answers that run to num_predict, which the re-plan test's lookups need
    # (seed 0's model ends its answer after 4 tokens since skewed models draw their residual
    # branches small: scripts/synth_routing.py)
    return synth_gguf.write_gguf(tmp_path_factory.mktemp("moe") / "moe.gguf", shape, "Q4_1",
                                 "noise", seed=1, routing="zipf:1", chat_template=TEMPLATE)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


def _serve(tmp_path: Path, models: dict[str, Path], **settings: str):
    env = isolated_env(tmp_path, LOCALLLM_EXPERT_CACHE_DEVICE="cpu",
                       LOCALLLM_CONTEXT_LENGTH="1024", LOCALLLM_CONTEXT_POLICY="fixed",
                       LOCALLLM_NUM_PARALLEL="1", **settings)
    import_models(env, models)
    return start_daemon(env)


@pytest.fixture(scope="module")
def answer_without_cache(tmp_path_factory, moe_gguf) -> dict:
    d = _serve(tmp_path_factory.mktemp("off"), {"moe": moe_gguf})
    try:
        answer = _post(f"{d.url}/api/chat", ASK)
        stats = d.get("/api/stats")["models"][0]
        assert stats["expert_cache"] is None
        assert stats["plan"]["expert_cache"] == 0
        assert "expert_cache" not in d.ps()[0]
        return answer
    finally:
        d.stop()


def test_a_daemon_with_the_setting_answers_alike_and_reports_hits(tmp_path, moe_gguf,
                                                                  smollm2_gguf,
                                                                  answer_without_cache):
    d = _serve(tmp_path, {"moe": moe_gguf, "dense": smollm2_gguf},
               LOCALLLM_EXPERT_CACHE="16")
    try:
        answer = _post(f"{d.url}/api/chat", ASK)
        text = answer["message"]["content"]
        assert answer["eval_count"] > 20 and len(set(text.split())) > 3  # a real comparison
        assert text == answer_without_cache["message"]["content"]

        stats = next(m for m in d.get("/api/stats")["models"] if m["model"] == "moe:latest")
        cache = stats["expert_cache"]
        assert cache["on"] and cache["slots"] == cache["planned_slots"] == 16
        assert cache["layers"] == 4
        lookups = cache["hits"] + cache["misses"]
        assert cache["hits"] > 0 and lookups >= 4 * 4 * answer["eval_count"]
        assert cache["hit_rate"] == round(cache["hits"] / lookups, 4)
        assert cache["swaps"] > 0 and cache["steps"] >= answer["eval_count"]
        from metrics_scrape import scrape, value

        metrics, m = scrape(d.url), {"model": "moe:latest"}
        assert value(metrics, "localllm_expert_cache_lookups",
                     "localllm_expert_cache_lookups_total", result="hit", **m) == cache["hits"]
        assert value(metrics, "localllm_expert_cache_lookups",
                     "localllm_expert_cache_lookups_total", result="miss", **m) == \
            cache["misses"]
        assert value(metrics, "localllm_expert_cache_swaps", "localllm_expert_cache_swaps_total",
                     **m) == cache["swaps"]
        assert stats["plan"]["expert_cache"] == 16
        assert any(r.startswith("expert cache on: 16 expert slots") and "in RAM" in r
                   for r in stats["plan"]["reasons"]), stats["plan"]["reasons"]
        # what the pool hit is kept for the tuner's next pricing of this model's pool (written
        # off the daemon's event loop, soon after the answer)
        def kept() -> dict | None:
            found = list(Path(d.env["XDG_CONFIG_HOME"]).glob("**/expert_hits.toml"))
            doc = tomllib.loads(found[0].read_text()) if found else {}
            return doc.get("moe:latest", {}).get(f"{16 / (4 * 32):.4f}")

        row = wait_for(kept, 30, what="the pool's hits recorded")
        assert (row["hits"], row["misses"]) == (cache["hits"], cache["misses"])

        ps = d.ps()[0]
        assert ps["expert_cache"]["slots"] == 16
        assert ps["expert_cache"]["text"] == (
            f"expert cache: 16 slots, {cache['hit_rate']:.0%} hits of {lookups} lookups, "
            f"{cache['swaps']} swaps, misses on the CPU")
        assert cache["misses_on"] == "cpu"  # a pool in RAM: the CPU computes them
        shown = d.cli("ps")
        assert shown.returncode == 0, shown.stderr
        assert f"moe:latest expert cache: 16 slots, {cache['hit_rate']:.0%} hits" in shown.stderr

        # a dense model under the same setting: loaded without a pool, and the plan says why
        dense = _post(f"{d.url}/api/generate", {"model": "dense", "prompt": "Hi", "stream": False,
                                                "options": {"num_predict": 4}})
        assert dense["done"]
        stats = next(m for m in d.get("/api/stats")["models"] if m["model"] == "dense:latest")
        assert stats["expert_cache"] is None and stats["plan"]["expert_cache"] == 0
        assert any(r.startswith("expert cache off:") and "dense model" in r
                   for r in stats["plan"]["reasons"]), stats["plan"]["reasons"]
        assert "dense:latest expert cache" not in d.cli("ps").stderr
    finally:
        d.stop()


def test_tune_measure_stores_the_pools_hit_rate_for_the_tuner(tmp_path, moe_gguf):
    # `tune --measure` on a plan with a pool decodes until the pool has seen MIN_LOOKUPS
    # lookups (4 blocks x 4 experts a token: 1250 tokens) and keeps what it hit, as serving does
    env = isolated_env(tmp_path, LOCALLLM_EXPERT_CACHE_DEVICE="cpu",
                       LOCALLLM_EXPERT_CACHE="16")
    import_models(env, {"moe": moe_gguf})
    result = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", "moe", "--measure",
                             "--ctx", "2048", "--json"], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout)
    assert out["plan"]["expert_cache"] == 16
    pool = out["measured"]["expert_cache"]
    assert pool["slots"] == 16 and pool["layers"] == 4
    assert pool["hits"] + pool["misses"] >= MIN_LOOKUPS and pool["hits"] > 0
    assert out["measured"]["decoded_tokens"] == -(-MIN_LOOKUPS // (4 * 4))
    [hits_file] = Path(env["XDG_CONFIG_HOME"]).glob("**/expert_hits.toml")
    kept = tomllib.loads(hits_file.read_text())["moe:latest"][f"{16 / (4 * 32):.4f}"]
    assert (kept["hits"], kept["misses"]) == (pool["hits"], pool["misses"])
    # what the tuner reads back for its next pricing of this model's pool
    assert measured_hits("moe:latest", moe_gguf.stat().st_size, hits_file) == (
        (16 / (4 * 32), pool["hits"] / (pool["hits"] + pool["misses"]),
         (pool["swaps"] - 16) / pool["steps"]),)  # the swaps after the 16 slots filled


FIRST_PRICE = 0.2


class PricedLow(Planner):
    """CPU plans with a pool of 16 slots (in RAM here) that the first load prices at a hit rate
    of FIRST_PRICE, the way `auto` prices a first load from the prior curve (this model's
    routing hits far more); later loads say what the tuner would, from the hits measured
    since (localllm/profiles/expert_hits.py)."""

    def __init__(self):
        self.priced_at: list[float] = []

    def choose(self, shape, model_name, n_ctx, options, draft_shape=None, hint=None):
        measured = measured_hits(model_name, shape.file_size)
        rate = measured[0][1] if measured else FIRST_PRICE
        self.priced_at.append(rate)
        # priced from its hits, a pool takes in experts at another pace (a load key that
        # differs: a plan that differed only in its price would be kept, not loaded again)
        return replace(cpu_plan(n_ctx or 1024, shape.context_length), expert_cache=16,
                       expert_cache_device="cpu", expected_hit_rate=rate,
                       expert_cache_swaps=8 if measured else 0)


async def test_a_pool_that_misses_its_price_is_planned_again_from_its_hits(
        store, moe_gguf, tmp_path):
    """`expert_cache = auto`: once the pool has MIN_LOOKUPS lookups and hits far from what its
    plan assumed, the model loads again once it has been idle replan_idle_s, priced from the
    hits it measured; once. A follow-up sent sooner is answered by the running plan: the
    re-plan comes between requests, never inside one."""
    entry = store.import_gguf(moe_gguf, "moe")
    name = str(entry.name)
    planner = PricedLow()
    scheduler = Scheduler(store, Config(expert_cache="auto"), tmp_path / "logs", planner)
    scheduler.replan_idle_s = 3600.0  # the follow-up below comes well inside it
    await scheduler.start()
    load = LoadOptions(num_ctx=1024)

    async def answer(runner) -> None:
        request = GenerationRequest(id="r", prompt="Name three colours of the sea at dusk.",
                                    options=SamplingOptions(num_predict=600, temperature=0))
        events = [e async for e in runner.generate(request)]
        assert isinstance(events[-1], Done), events[-1]

    try:
        first = None
        for _ in range(10):  # 16 lookups a token (4 blocks x 4 experts): about 1250 tokens
            async with scheduler.use(entry, load) as runner:
                first = first or runner
                assert runner is first  # no reload before the pool has its lookups
                await answer(runner)
            if scheduler.models[name].replan:
                break
        pool = first.expert_cache
        lookups = pool.hits + pool.misses
        assert lookups >= MIN_LOOKUPS and pool.hits / lookups - FIRST_PRICE >= REPLAN_HIT_GAP
        assert scheduler.models[name].replan == (
            f"its expert cache hit {pool.hits / lookups:.0%} of {lookups} lookups where the "
            f"plan assumed {FIRST_PRICE:.0%}")
        await drained()  # written off the event loop (the next load's planning waits so too)
        assert measured_hits(name, entry.model_path.stat().st_size)  # stored for the tuner

        async with scheduler.use(entry, load) as runner:  # a follow-up: no wait for a load
            assert runner is first and planner.priced_at == [FIRST_PRICE]
        scheduler.replan_idle_s = 0.0  # idle long enough now: the reaper loads it again
        scheduler._wake.set()
        deadline = time.monotonic() + 120
        while (model := scheduler.models.get(name)) is None or model.runner is first:
            assert time.monotonic() < deadline, "not loaded again once idle"
            await asyncio.sleep(0.05)  # ok-sleep: polls the reaper's reload with a deadline
        assert not first.alive
        async with scheduler.use(entry, load) as runner:
            assert runner is scheduler.models[name].runner
            assert planner.priced_at == [FIRST_PRICE, pytest.approx(pool.hits / lookups)]
            assert runner.plan.expected_hit_rate == planner.priced_at[1]
            await answer(runner)
        assert not scheduler.models[name].replan  # priced from its own hits: no second time
    finally:
        await scheduler.close()


async def _answer(runner: RunnerProcess, prompt: str, rid: str) -> Done:
    request = GenerationRequest(id=rid, prompt=prompt, options=SamplingOptions(
        num_predict=8, temperature=0, seed=1))
    return [e async for e in runner.generate(request) if isinstance(e, Done)][0]


async def test_the_pool_reported_is_the_running_bands(moe_gguf, tmp_path):
    """Fill bands whose plans differ in the pool: after a move to a band without one, the
    runner reports none (lease G's ps showed the 8K band's 1024 slots for a 32K band that had
    no pool); after a move to a band with one, that pool's figures, from its own context."""
    whole = dataclasses.replace(cpu_plan(2048), n_parallel=1)
    pooled = dataclasses.replace(whole, expert_cache=16, expert_cache_device="cpu")
    long_prompt = " ".join(f"Fact {i}: the sea holds {i * 7} fish." for i in range(60))
    for name, small, big in (("pool first", dataclasses.replace(pooled, n_ctx=512), whole),
                             ("pool after", dataclasses.replace(whole, n_ctx=512), pooled)):
        runner = RunnerProcess("moe", moe_gguf, big, tmp_path / f"{name}.log", bands=(small,))
        await runner.start()
        try:
            await _answer(runner, "The sea at dusk is", "short")
            assert runner.band == 0
            assert (runner.expert_cache is not None) == bool(small.expert_cache), name
            done = await _answer(runner, long_prompt, "long")
            assert done.prompt_tokens > 512 and runner.band == 1, name
            if big.expert_cache:
                assert runner.expert_cache is not None, name
                assert runner.expert_cache.slots == 16
                assert runner.expert_cache.hits + runner.expert_cache.misses > 0
            else:
                assert runner.expert_cache is None, name
        finally:
            await runner.stop()
