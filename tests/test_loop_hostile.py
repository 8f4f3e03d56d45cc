"""Input that stretches work the daemon does (issue 68, item 1): while each hostile input is
served, another client's chat keeps being answered, and the input ends in an answer or a
refusal. Asserted by progress, not by a tight time bound (the CI machine is 2 busy cores): the
other client's one-token chats, sent one after another, never wait STALL_S between two answers,
where each input below held every client 15 s to minutes before (sized so).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
from daemon_process import wait_for
from test_tool_search import SEARCH, SEARCH_TEMPLATE
from test_wedges import post

STALL_S = 10.0
OTHER = "gemma3-270m"  # the other client's model: a runner of its own


class Heartbeat:
    """Another client: one-token chats to `model`, one after another, each answer's time kept."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.answered: list[float] = []
        self.failed: list[tuple[int, dict]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            code, body = post(self.url + "/api/generate", {
                "model": self.model, "prompt": "hi", "stream": False,
                "options": {"num_predict": 1}}, timeout=600)
            if code == 200:
                self.answered.append(time.monotonic())
            else:
                self.failed.append((code, body))


def served_beside(daemon, model: str, hostile):
    """`hostile()` (a request, or a file and the wait for the daemon to read it), run while
    another client chats with `model`; its result once every gap between that client's answers
    over the whole of it was under STALL_S."""
    beat = Heartbeat(daemon.url, model)
    wait_for(lambda: beat.answered, 120, what="the other client's first answer")
    started = time.monotonic()
    result = hostile()
    ended = time.monotonic()
    wait_for(lambda: beat.answered[-1] > ended, 600, what="an answer after the hostile input")
    beat.stop.set()
    beat.thread.join(600)
    assert not beat.failed, beat.failed[:3]
    times = [started, *(t for t in beat.answered if started < t <= ended),
             next(t for t in beat.answered if t > ended)]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    print(f"{len(times) - 2} other answers during {ended - started:.1f}s, longest wait "
          f"{max(gaps):.2f}s")
    assert max(gaps) < STALL_S, f"the other client waited {max(gaps):.1f}s for an answer"
    return result


@pytest.fixture(scope="module")
def hd(tmp_path_factory, smollm2_gguf, gemma_gguf):
    from conftest import import_models
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path_factory.mktemp("hostile"))
    import_models(env, {"smollm2": smollm2_gguf, OTHER: gemma_gguf})
    d = start_daemon(env)
    # A copy of smollm2 whose template shows it calling the search with `(a+)+b`: the call the
    # model makes is the test's (temperature 0 copies it), as a prompt injection's would be.
    template = SEARCH_TEMPLATE.replace('"query": "weather"', '"query": "(a+)+b"')
    assert '"(a+)+b"' in template
    assert post(d.url + "/api/create", {"model": "smollm2-spin", "from": "smollm2",
                                        "template": template, "stream": False,
                                        "parameters": {"temperature": 0}})[0] == 200
    for model in ("smollm2", OTHER):
        assert post(d.url + "/api/generate", {"model": model, "prompt": "", "stream": False,
                                              "keep_alive": "1h"})[0] == 200
    yield d
    d.stop()


def test_a_backtracking_tool_search_stops_at_its_limit_and_holds_no_one(hd):
    """`(a+)+b` over a 28-letter description: about a minute of Python's `re` (doubling with
    each letter), all of it on the event loop before; now a worker is killed at 1 s, and the
    model reads why."""
    spin = {"name": "spin", "description": "a" * 28, "input_schema": {"type": "object"},
            "defer_loading": True}
    code, answer = served_beside(hd, OTHER, lambda: post(hd.url + "/v1/messages", {
        "model": "smollm2-spin", "max_tokens": 40, "tools": [SEARCH, spin],
        "messages": [{"role": "user", "content": "Go."}]}))
    assert code == 200, answer
    results = [b for b in answer["content"] if b["type"] == "tool_search_tool_result"]
    assert results and results[0]["content"]["type"] == "tool_search_tool_result_error", answer
    assert "took too long" in results[0]["content"]["error_message"]


def test_30000_tool_references_are_looked_up_by_name(hd):
    """30,000 references to tools that are not there, against 10,000 deferred tools: 300
    million name comparisons on the event loop before (a linear scan each)."""
    tools = [{"name": f"mcp__srv__tool_{i}", "description": "does a thing",
              "input_schema": {"type": "object"}, "defer_loading": True} for i in range(10000)]
    references = [{"type": "tool_reference", "tool_name": f"gone_{i}"} for i in range(30000)]
    body = {"model": "smollm2-spin", "tools": [SEARCH, *tools], "messages": [
        {"role": "user", "content": "find a tool"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "ToolSearch", "input": {"query": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": references}]}]}
    code, counted = served_beside(hd, OTHER, lambda: post(
        hd.url + "/v1/messages/count_tokens", body))
    assert code == 200 and counted["input_tokens"] > 0, counted


def test_counting_a_text_of_special_tokens_holds_the_same_models_chats_briefly(hd):
    """A count of 3,000 messages of 25 `<|im_end|>` each (830 KB): llama.cpp's tokenizer copies
    the rest of the text at each special token it finds, so it took the model's runner about
    30 s (quadratic; 20,000 plain messages 13-25 s), every chat of that model waiting; now it
    reads the text in pieces, in linear time."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": "<|im_end|>" * 25}
                for i in range(2999)]
    code, counted = served_beside(hd, "smollm2", lambda: post(
        hd.url + "/v1/messages/count_tokens", {"model": "smollm2", "messages": messages}))
    assert code == 200, counted
    assert counted["input_tokens"] > 2999 * 25, counted


def _refused(daemon, name: str) -> bool:
    log = Path(daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
    return any(name in line and "not a regular file" in line
               for line in log.read_text().splitlines())


@pytest.mark.errors_expected
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
def test_a_fifo_or_a_device_among_the_profiles_is_refused_unread(hd, kind):
    """A FIFO there froze the daemon (the watcher opened it on the event loop, waiting for a
    writer forever); a link to /dev/zero was read until the kernel killed the daemon at 23 GB.
    Now the watcher reads, in its own thread, only regular files, and says so."""
    folder = Path(hd.env["XDG_CONFIG_HOME"]) / "localllm" / "profiles"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{kind.split()[0]}@rtx3060-12g.toml"

    def drop_it():
        if kind == "fifo":
            os.mkfifo(path)
        else:
            path.symlink_to("/dev/zero")
        return wait_for(lambda: _refused(hd, path.name), 120, what="the watcher's refusal")

    assert served_beside(hd, OTHER, drop_it)
    assert hd.get("/api/version")["version"]  # still up
