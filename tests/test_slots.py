"""The slot runner: parallel requests, cancellable prefill, prefix reuse with sliding windows,
and a runner client that fails closed. Real daemons, real llama.cpp, real models."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import ollama
import pytest
from daemon_process import isolated_env, start_daemon, wait_for

ROOT = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0, "num_predict": 24}
PROMPTS = ["Why is the sky blue?", "Write a haiku about rust.", "What is the capital of Peru?",
           "Name three kinds of trees."]


@pytest.fixture
def parallel_daemon(tmp_path, smollm2_gguf, gemma_gguf):
    from conftest import import_models

    env = isolated_env(tmp_path, LOCALLLM_NUM_PARALLEL="4")
    import_models(env, {"smollm2": smollm2_gguf, "gemma3-270m": gemma_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


def status_of(daemon, name="smollm2:latest") -> dict | None:
    return {m["model"]: m for m in daemon.get("/api/status")["loaded"]}.get(name)


def last_read(daemon, name="gemma3-270m:latest") -> int:
    """Prompt tokens the runner read for its last request (the cached prefix not counted)."""
    model = next(m for m in daemon.get("/api/stats")["models"] if m["model"] == name)
    return model["last"]["prompt_eval_count"]


def test_four_parallel_requests_overlap_and_answer_as_they_do_alone(parallel_daemon):
    client = ollama.Client(host=parallel_daemon.url)
    alone = [client.chat(model="smollm2", messages=[{"role": "user", "content": p}],
                         options=GREEDY).message.content for p in PROMPTS]
    assert status_of(parallel_daemon)["num_parallel"] == 4
    first_token: dict[int, float] = {}
    finished: dict[int, float] = {}
    texts: dict[int, str] = {}

    def ask(i: int) -> None:
        parts = []
        stream = ollama.Client(host=parallel_daemon.url).chat(
            model="smollm2", messages=[{"role": "user", "content": PROMPTS[i]}],
            options=GREEDY, stream=True)
        for chunk in stream:
            if chunk.message.content and i not in first_token:
                first_token[i] = time.monotonic()
            parts.append(chunk.message.content)
        finished[i] = time.monotonic()
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [texts.get(i) for i in range(4)] == alone
    # Served together, not in turn: every answer had begun before the first one ended.
    assert max(first_token.values()) < min(finished.values())
    ps = parallel_daemon.cli("ps")
    assert ps.returncode == 0 and "SLOTS" in ps.stdout and "0/4" in ps.stdout


def test_cancelling_during_a_long_prompt_stops_the_runner_before_the_prompt_is_read(
        parallel_daemon):
    """Measured in tokens, not seconds: the runner stops reading the prompt part-way through
    (a busy machine slows both the reading and the cancel, so a time bound proves nothing)."""
    prompt = " ".join(f"item{i % 100}" for i in range(1000))  # about 3,000 tokens
    body = json.dumps({"model": "smollm2", "prompt": prompt, "raw": True, "stream": True,
                       "options": {"num_ctx": 4096, "num_predict": 8}}).encode()
    host, port = parallel_daemon.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)), timeout=60)
    conn.sendall(b"POST /api/generate HTTP/1.1\r\nHost: localhost\r\n"
                 b"Content-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    received = b""
    deadline = time.monotonic() + 120
    while b'"prompt_read"' not in received:  # the runner has read a first chunk of the prompt
        assert time.monotonic() < deadline and b'"error"' not in received, received[-300:]
        received += conn.recv(65536)
    line = next(json.loads(x) for x in received.split(b"\n") if b'"prompt_read"' in x)
    total = line["progress"]["prompt_total"]
    assert 2500 < total < 4096 and line["progress"]["prompt_read"] < total
    conn.close()
    wait_for(lambda: status_of(parallel_daemon)["active"] == 0, timeout=60,
             what="the request to end")
    log = (Path(parallel_daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "runner.log")
    cancelled = re.search(r"cancelled after (\d+) answer tokens, (\d+) of (\d+) prompt tokens",
                          log.read_text())
    assert cancelled, log.read_text()[-2000:]
    answer, read, whole = map(int, cancelled.groups())
    assert answer == 0 and whole == total
    assert read < total  # the rest of the prompt was never read


def test_a_prefix_past_the_sliding_window_is_read_again_not_reused(parallel_daemon):
    """Gemma 3's sliding-window layers keep only the last 512 positions. After a 1,600-token
    prompt, a request sharing its first 900 tokens cannot reuse them (their window, positions
    past 1,088 now, was overwritten): it must read them again and answer as a cold run does."""
    client = ollama.Client(host=parallel_daemon.url)
    words = [f"w{i}" for i in range(420)]
    options = {"temperature": 0, "num_predict": 16, "num_ctx": 4096}
    first = client.generate(model="gemma3-270m", prompt=" ".join(words) + " end.",
                            options=options)
    assert first.prompt_eval_count > 1500  # past the shared prefix's end plus the window
    second_prompt = " ".join(words[:250]) + " Then the story turned: once upon a time"
    warm = client.generate(model="gemma3-270m", prompt=second_prompt,
                           options=options)
    warm_read = last_read(parallel_daemon)
    # A prefix within the window is reused: the same prompt again reads one token. (Its text
    # may differ from warm's: that last token is read alone here, in a chunk there, and
    # llama.cpp's CPU kernels round the two differently.)
    again = client.generate(model="gemma3-270m", prompt=second_prompt,
                            options=options)
    assert again.prompt_eval_count == warm.prompt_eval_count  # the whole input, as Ollama
    assert last_read(parallel_daemon) <= 2
    assert parallel_daemon.cli("stop", "gemma3-270m").returncode == 0
    cold = client.generate(model="gemma3-270m", prompt=second_prompt,
                           options=options)
    cold_read = last_read(parallel_daemon)
    assert warm_read == cold_read  # nothing stale was reused
    assert warm.response == cold.response


async def test_a_runner_that_writes_garbage_fails_the_request_and_the_next_one_loads_fresh(
        store, smollm2_gguf, tmp_path, monkeypatch):
    from localllm.daemon.scheduler import Scheduler
    from localllm.engine.runner.protocol import Done, Failure, GenerationRequest, SamplingOptions

    from localllm.config import Config
    from localllm.options import LoadOptions

    monkeypatch.setenv("GARBAGE_MARKER", str(tmp_path / "garbage-once"))
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    scheduler = Scheduler(store, Config(num_parallel=1), tmp_path / "logs",
                          runner_command=(sys.executable,
                                          str(ROOT / "tests" / "garbage_runner.py")))
    await scheduler.start()

    async def answer() -> tuple[list, int]:
        request = GenerationRequest(id="g", prompt="Once upon a time",
                                    options=SamplingOptions(num_predict=40, temperature=0))
        async with scheduler.use(entry, LoadOptions(num_ctx=1024)) as runner:
            return [e async for e in runner.generate(request)], runner.pid

    try:
        events, first_pid = await answer()
        assert isinstance(events[-1], Failure)
        assert "unreadable message" in events[-1].message
        events, second_pid = await answer()
        assert isinstance(events[-1], Done) and events[-1].eval_count == 40
        assert second_pid != first_pid
    finally:
        await scheduler.close()


def test_the_sampler_chain_takes_every_ollama_option(parallel_daemon):
    """Ollama's default sampling (with a repeat penalty fed the prompt) and a strong penalty
    that must change a greedy answer that repeats itself."""
    client = ollama.Client(host=parallel_daemon.url)
    prompt = "Write a haiku about rust."
    sampled = client.generate(model="smollm2", prompt=prompt, options={
        "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "typical_p": 0.95,
        "repeat_penalty": 1.1, "repeat_last_n": 64, "presence_penalty": 0.5,
        "frequency_penalty": 0.5, "seed": 7, "num_predict": 24})
    assert sampled.eval_count == 24
    plain = client.generate(model="smollm2", prompt=prompt, options={**GREEDY, "num_predict": 40})
    penalized = client.generate(model="smollm2", prompt=prompt, options={
        **GREEDY, "num_predict": 40, "repeat_penalty": 2.0, "repeat_last_n": -1})
    assert plain.response != penalized.response
    no_penalty_window = client.generate(model="smollm2", prompt=prompt, options={
        **GREEDY, "num_predict": 40, "repeat_penalty": 2.0, "repeat_last_n": 0})
    assert no_penalty_window.response == plain.response  # Ollama: repeat_last_n 0 disables it


CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}\n" for i in range(20))


def test_prompt_lookup_drafts_from_the_prompt_and_reports_it(parallel_daemon):
    """Asked to repeat a listing, the runner drafts from the prompt and the model accepts
    many drafts; the counts come back on every chunk and in the final object. Without the
    option nothing is drafted, and the modes not built yet are refused."""
    messages = [{"role": "user", "content": f"Repeat this code exactly:\n{CODE}"}]
    options = {**GREEDY, "num_predict": 160}

    def chat(extra: dict) -> list[dict]:
        body = json.dumps({"model": "smollm2", "messages": messages,
                           "options": {**options, **extra}}).encode()
        req = urllib.request.Request(parallel_daemon.url + "/api/chat", data=body)
        with urllib.request.urlopen(req, timeout=300) as resp:
            return [json.loads(line) for line in resp]

    parts = chat({"speculative": "lookup"})
    final = parts[-1]
    drafts = [p["stats"]["draft"] for p in parts[:-1] if "draft" in p.get("stats", {})]
    assert drafts, "no chunk carried draft statistics"
    counts = final["stats"]["draft"]
    assert counts["drafted"] > 0 and 0 < counts["accepted"] <= counts["drafted"]
    assert final["eval_count"] == 160
    assert all("draft" not in p.get("stats", {}) for p in chat({}))
    for mode in ("mtp", "bogus"):
        with pytest.raises(urllib.error.HTTPError) as e:
            chat({"speculative": mode})
        assert e.value.code == 400
