"""Issue 36: plans follow the traffic that arrives. The daemon keeps, per model, the lengths of
the prompts and answers it served (a small owner-only record in the state dir) and plans the
next load for that mix; before any record, an agent's route is a hint; a band above the first is
planned for the long prompt that enters it. Real daemon, real llama.cpp, real SmolLM2, real
clients."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import anthropic
import ollama
import pytest
from dataclasses import replace

from conftest import import_models
from daemon_process import isolated_env, start_daemon, wait_for
from localllm.profiles import acceptance, traffic
from localllm.profiles.served import ServedRecords, drained
from localllm.planner.workload import AGENT, CHAT, MIN_LEARNED, learned

# About 2250 tokens: a long prompt (LONG_PROMPT is 2048) that a busy 2-core CPU reads soon.
LONG = " ".join(f"Fact {i}: the {['cold', 'deep', 'blue', 'salty'][i % 4]} water holds "
                f"{i * 7} fish." for i in range(140)) + " How many facts are there?"


# ---- what is learned from what -----------------------------------------------------------------

def test_a_run_of_long_prompts_is_learned_as_an_agents_mix_and_short_turns_as_a_chat():
    assert learned([(3000, 3000, 4)] * (MIN_LEARNED - 1)) is None  # too little to go on
    long = learned([(3100, 3100, 4)] * MIN_LEARNED)
    assert long.name == "agent" and long.first_prompt == 3100 and long.answer == 4
    assert long.turns == 1  # nothing reused: each request is a session of its own
    # A chat: a short first prompt, then turns that reuse the conversation and add a little.
    chat = [(300, 300, 200), (620, 120, 180), (930, 110, 220), (1250, 100, 200),
            (1560, 110, 190), (300, 300, 150)]
    mix = learned(chat)
    assert mix.name == "chat" and mix.first_prompt == 300 and mix.turn_prompt in (110, 120)
    assert mix.turns > 3  # as deep as the conversations went
    # An agent: a long system prompt, then tool results turn after turn.
    agent = [(20000, 20000, 256)] + [(20000 + 2300 * k, 2048, 256) for k in range(1, 8)]
    mix = learned(agent)
    assert mix.name == "agent" and mix.first_prompt == 20000 and mix.turn_prompt == 2048


def test_a_band_above_the_first_is_planned_for_the_prompt_that_enters_it():
    entering = CHAT.entering(8192, 32768)
    # A chat's short prompts never move a runner up: the long prompt that does is an agent's or
    # an editor's, and tool results and short answers follow it.
    assert entering.first_prompt == 16384 and entering.name == "agent (long prompt)"
    assert (entering.turn_prompt, entering.answer) == (AGENT.turn_prompt, AGENT.answer)
    assert AGENT.entering(8192, 32768) is AGENT  # its 20K first prompt enters that band
    assert AGENT.entering(32768, 131072).first_prompt == 65536
    assert CHAT.entering(8192, 12000).first_prompt == 12000 - AGENT.answer  # capped at the band
    # A learned mix of long prompts keeps its own turns.
    mix = learned([(3000, 3000, 40), (5000, 2000, 40), (3000, 3000, 40), (5200, 2200, 40)])
    assert mix.entering(8192, 32768).turn_prompt == mix.turn_prompt


# ---- the record --------------------------------------------------------------------------------

def test_the_record_is_small_owner_only_and_rolls(home):
    path = traffic.traffic_file()
    for m in range(12):
        for i in range(40):
            traffic.record(f"model-{m}", 16000 + i, 16000, 256)
    doc = json.loads(path.read_text())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.stat().st_size < 6 * 1024  # a few KB, however much is served
    models = doc["models"]
    assert len(models) == traffic.MAX_MODELS
    assert set(models) == {f"model-{i}" for i in range(4, 12)}  # the least recent went
    assert all(len(rows) == traffic.KEEP for rows in models.values())
    assert models["model-11"][-1] == [16000 + 39, 16000, 256]  # the newest stays
    path.write_text("{not json")  # a damaged record is started again, not fatal
    traffic.record("m", 100, 100, 10)
    assert traffic.served("m") == [(100, 100, 10)]


def test_the_workload_starts_from_the_config_or_the_route_then_is_learned(home):
    workload, source = traffic.starting_workload("auto", "m")
    assert workload == CHAT and source == "default (chat)"
    workload, source = traffic.starting_workload("auto", "m", "/v1/messages")
    assert workload == AGENT and source == "route hint (/v1/messages)"
    workload, source = traffic.starting_workload("chat", "m", "tools")  # the user's word first
    assert workload == CHAT and source == "config (workload = chat)"
    for _ in range(MIN_LEARNED):
        traffic.record("m", 3000, 3000, 8)
    workload, source = traffic.starting_workload("chat", "m", "tools")
    assert workload.name == "agent" and source == f"learned from {MIN_LEARNED} requests"


# ---- through the daemon ------------------------------------------------------------------------

@pytest.fixture
def daemon(tmp_path, smollm2_gguf):
    env = isolated_env(tmp_path / "d")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


def test_an_agents_route_plans_the_first_load_for_the_agent_mix(daemon):
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    client.messages.create(model="smollm2", max_tokens=2,
                           messages=[{"role": "user", "content": "Hello"}])
    [loaded] = daemon.ps()
    assert loaded["workload"]["source"] == "route hint (/v1/messages)"
    assert loaded["workload"]["planned_for"].startswith(
        "agent: conversations that open with about 20000 tokens")
    done = daemon.cli("ps")
    assert done.returncode == 0 and "smollm2:latest planned for: agent" in done.stderr


def test_after_a_run_of_long_prompts_the_next_load_is_planned_for_them(daemon):
    client = ollama.Client(host=daemon.url)
    client.generate(model="smollm2", prompt="Hello", options={"num_predict": 2})
    [first] = daemon.ps()
    assert first["workload"]["source"] == "default (chat)"
    assert first["workload"]["planned_for"].startswith("chat:")
    long_ones = MIN_LEARNED - 1  # with the short one, the record's median prompt is long
    for i in range(long_ones):
        answer = client.generate(model="smollm2", prompt=f"{i} {LONG}", raw=True,
                                 options={"num_predict": 4, "temperature": 0},
                                 keep_alive=0 if i == long_ones - 1 else None)
        assert answer.prompt_eval_count > 2048
    record = Path(daemon.env["XDG_STATE_HOME"]) / "localllm" / "workload.json"

    def rows_kept() -> list:  # written off the daemon's event loop, soon after each answer
        doc = json.loads(record.read_text()) if record.exists() else {}
        rows = doc.get("models", {}).get("smollm2:latest", [])
        return rows if len(rows) == MIN_LEARNED else []

    rows = wait_for(rows_kept, 30, what="the workload record of every answer")
    assert stat.S_IMODE(os.stat(record).st_mode) == 0o600
    assert len(rows) == MIN_LEARNED and all(p > 2048 and a <= 4 for p, _, a in rows[1:])

    # The next load: planned for the mix served, which ps shows with where it came from.
    client.generate(model="smollm2", prompt="Hello", options={"num_predict": 2})
    [loaded] = daemon.ps()
    assert loaded["workload"]["source"] == f"learned from {MIN_LEARNED} requests"
    assert loaded["workload"]["planned_for"].startswith("agent: requests of about ")

    # `tune` plans it the same way for a card it would not fit on: the weights partly in RAM,
    # a long prompt read in micro-batches of 512 or more (1.1 GiB: less the 0.5 GiB margin,
    # the CUDA context and the pool of its kernels' temporaries take 460 MiB of it).
    done = daemon.cli("tune", "smollm2", "--card", "rtx3060-12g", "--vram", "1.1", "--ctx",
                      "4096", "--json", "--no-save", timeout=300)
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    assert plan["workload"].startswith("agent: requests of about ") and \
        plan["workload_source"].startswith("learned from ")
    assert plan["n_ubatch"] >= 512
    assert next(m["weights"] for m in plan["memory"] if m["device"] == "CPU") > 0
    assert plan["n_gpu_layers"] > 0
    text = daemon.cli("tune", "smollm2", "--card", "rtx3060-12g", "--vram", "1.1", "--ctx",
                      "4096", "--no-save", timeout=300)
    assert (f"workload (learned from {MIN_LEARNED + 1} requests): agent: requests of about "
            in text.stdout)


# ---- the shapes, planned on the CPU ----------------------------------------------------

@pytest.mark.parametrize("name", ["dense-27b", "qwen35-27b"])
def test_with_default_settings_the_band_a_16k_prompt_enters_reads_it_as_the_agent_plan(
        name, tmp_path_factory):
    """The H200 measurement of issue 36 (12 GiB, 32K, default settings): the runner starts in
    the 8K band and moves to the 32K band's plan for a 16K prompt. That band, priced for a
    chat, read the prompt at 214 (dense) and 393 tok/s (Qwen3.5 shape), the agent workload's
    plan 895; fit q8_0 405 and 772. Planned for the prompt that enters it, it reads it at least
    as fast as the agent workload's plan, and the first band stays the chat's."""
    from scripts import synth_gguf

    from localllm.modelstore.shape import read_shape
    from localllm.profiles.bands import band_plans, band_pays
    from localllm.planner.card import GIB, MIB, load_card
    from localllm.planner.search import Request
    from localllm.planner.tuner import tune

    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    shape = read_shape(paths[name])
    card = load_card("h200").with_host(ram_bytes=128 * GIB, cores=16,
                                       host_bandwidth_gbs=51.2).with_vram(12)
    default = Request(n_ctx=32768, margin_bytes=128 * MIB, workload=CHAT, num_parallel=None)
    whole = tune(shape, card, default)
    (_, first), (_, entered) = band_plans(shape, card, default, whole_plan=whole)
    assert band_pays(first, whole)  # the daemon loads the bands
    assert first.workload.startswith("chat:") and first.n_ubatch >= 512
    agent = tune(shape, card, replace(default, workload=AGENT))
    ttft = dict(entered.predicted_ttft)[16384]
    assert ttft <= dict(agent.predicted_ttft)[16384] * 1.1
    assert 16384 / ttft > 1.2 * {"dense-27b": 405, "qwen35-27b": 772}[name]  # fit q8_0
    assert any("planned for the prompt that moves a runner past 8192" in r
               for r in entered.reasons)


# ---- the records, off the event loop ----------------------------------------------------------

async def test_what_serving_teaches_the_tuner_is_written_off_the_event_loop_in_order(
        home, monkeypatch):
    writers: list[str] = []
    real = traffic.record
    monkeypatch.setattr(traffic, "record", lambda *args: (
        writers.append(threading.current_thread().name), real(*args))[1])
    records = ServedRecords("m", 100)
    for i in range(3):
        records.answered(1000 + i, 900, 10)
    await drained()  # the planner of the next load waits for them so
    assert traffic.served("m") == [(1000, 900, 10), (1001, 900, 10), (1002, 900, 10)]
    assert len(writers) == 3 and threading.current_thread().name not in writers
    assert all(name.startswith("tuner-records") for name in writers)

    # Draft acceptance: written once a mode has drafted FLUSH_DRAFTED tokens, not per answer.
    kept = acceptance.acceptance_file()
    records.drafted("lookup", ServedRecords.FLUSH_DRAFTED - 1, 30)
    await drained()
    assert not kept.exists()
    records.drafted("lookup", 1, 1)
    await drained()
    assert kept.exists() and "lookup" in kept.read_text()
