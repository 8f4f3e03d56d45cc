"""What the daemon's log says about requests: one info line per request (method, path, status,
duration, bytes, the client's name; never a body, a key or the query string), an idle unload
at info, not as a warning; and the Anthropic stream's message_start counting the prompt.
A real daemon, its real log file, the real `anthropic` client."""

from __future__ import annotations

import re
from pathlib import Path

import anthropic
import httpx

from daemon_process import wait_for

SECRET = "sk-query-secret-7d1e"
BODY_MARK = "body-marker-5b2f"


def log_text(daemon) -> str:
    path = Path(daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
    return path.read_text()


def access_lines(daemon, path: str) -> list[str]:
    return [line for line in log_text(daemon).splitlines()
            if "logger=localllm.access" in line and f" {path} " in line]


def test_every_request_is_one_info_line_without_bodies_keys_or_query(agent_daemon):
    before = len(access_lines(agent_daemon, "/v1/messages"))
    reply = httpx.post(f"{agent_daemon.url}/v1/messages?beta=true&key={SECRET}", timeout=120,
                       headers={"x-api-key": SECRET, "User-Agent": "claude-cli/2.1.332 (x)"},
                       json={"model": "smollm2", "max_tokens": 0,
                             "messages": [{"role": "user", "content": BODY_MARK}]})
    assert reply.status_code == 400  # a refusal is logged too: it was invisible before
    lines = wait_for(lambda: access_lines(agent_daemon, "/v1/messages")[before:] or None,
                     timeout=10, what="the access log line")
    assert len(lines) == 1
    line = lines[0]
    assert "level=info" in line and 'msg="POST /v1/messages 400"' in line
    assert "status=400" in line and "client=claude-cli/2.1.332" in line
    assert int(re.search(r" ms=(\d+)", line)[1]) >= 0
    # Bytes sent: the headers and the body.
    assert len(reply.content) < int(re.search(r" bytes=(\d+)", line)[1]) < 1000
    text = log_text(agent_daemon)
    assert SECRET not in text and BODY_MARK not in text and "beta=true" not in text


def test_a_streamed_answer_is_logged_when_it_ends_with_the_bytes_sent(agent_daemon):
    before = len(access_lines(agent_daemon, "/v1/chat/completions"))
    with httpx.stream("POST", f"{agent_daemon.url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2", "max_tokens": 3, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as reply:
        sent = sum(len(chunk) for chunk in reply.iter_raw())
    lines = wait_for(lambda: access_lines(agent_daemon, "/v1/chat/completions")[before:]
                     or None, timeout=10, what="the access log line")
    assert "status=200" in lines[0]
    assert sent < int(re.search(r" bytes=(\d+)", lines[0])[1]) < sent + 1000


def test_message_start_counts_a_long_prompt_before_its_first_token(agent_daemon):
    """Claude Code reads the prompt's size from message_start; a prompt long enough to be read
    in chunks used to say 0 there."""
    client = anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)
    system = " ".join(f"rule{i % 97}" for i in range(900))  # about 2,700 tokens: chunks
    events = list(client.messages.create(
        model="smollm2", max_tokens=2, system=system, stream=True,
        messages=[{"role": "user", "content": "hi"}], extra_body={"num_ctx": 4096}))
    start, delta = events[0], [e for e in events if e.type == "message_delta"][-1]
    assert start.type == "message_start"
    first = start.message.usage
    assert first.input_tokens + first.cache_read_input_tokens > 2000
    assert (first.input_tokens + first.cache_read_input_tokens
            == delta.usage.input_tokens + delta.usage.cache_read_input_tokens)


def test_an_idle_unload_is_logged_at_info(agent_daemon):
    reply = httpx.post(f"{agent_daemon.url}/api/generate", timeout=120, json={
        "model": "smollm2-thinking", "prompt": "hi", "stream": False, "keep_alive": "1s",
        "options": {"num_predict": 1}})
    assert reply.status_code == 200
    wait_for(lambda: not any(m["model"] == "smollm2-thinking:latest" for m in agent_daemon.ps()),
             timeout=60, what="the idle unload")
    lines = wait_for(lambda: [line for line in log_text(agent_daemon).splitlines()
                              if "runner for smollm2-thinking:latest" in line
                              and "exit code 0" in line] or None,
                     timeout=10, what="the runner's exit line")
    assert all("level=info" in line and " stopped: " in line for line in lines), lines
