"""Compaction on the cached conversation: Codex's (POST /v1/responses/compact, and the
`compaction_trigger` item on /v1/responses), the Messages API's `context_management` edits
(compact_20260112, clear_tool_uses_20250919) and Claude Code's own summarising turn. Each
compacting turn is the conversation as it was with the instruction appended, so it reads
again at most a tenth of the transcript's tokens (the usage figures the daemon reports:
cached tokens against the prompt), and its usage is never zero.

Against a real daemon (SmolLM2 with a Qwen-style tool template, greedy) through plain HTTP, as
the agents send it."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
import pytest

MODEL = "smollm2-tools"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"


def filler(words: int = 600) -> str:
    """A long tool output, as a file read or a test run prints (a few thousand tokens)."""
    lines = [f"line {i}: def handler_{i}(request): return render(request, 'page_{i}.html')"
             for i in range(words // 10)]
    return "\n".join(lines)


@pytest.fixture
def session() -> str:
    """A conversation of its own for each test: nothing of it cached before."""
    return uuid.uuid4().hex


def fresh(usage: dict, cached_key: str) -> int:
    """The prompt tokens a turn read afresh, from its usage figures."""
    if cached_key == "input_tokens_details":  # Responses: input_tokens counts the whole prompt
        return usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
    return usage["input_tokens"]  # Messages: input_tokens is what was not read from the cache


# ---- Codex: the Responses API ------------------------------------------------------------------
def codex_input(session: str) -> list[dict]:
    return [
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"Session {session}. Fix the failing handler."}]},
        {"type": "function_call", "call_id": "call_1", "name": "exec_command",
         "arguments": json.dumps({"cmd": "cat app/handlers.py"})},
        {"type": "function_call_output", "call_id": "call_1", "output": filler()},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Which handler renders page 7?"}]}]


def codex_turn(url: str, input_items: list[dict], **extra) -> dict:
    body = {"model": MODEL, "instructions": "You are Codex, a coding agent.",
            "input": input_items, "store": False, "max_output_tokens": 8, **extra}
    reply = httpx.post(f"{url}/v1/responses", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_codex_compact_endpoint_summarises_on_the_cached_conversation(agent_daemon, session):
    history = codex_input(session)
    last = codex_turn(agent_daemon.url, history)  # the turn before the compaction
    transcript = last["usage"]["input_tokens"]
    history += [item for item in last["output"] if item["type"] == "message"]
    reply = httpx.post(f"{agent_daemon.url}/v1/responses/compact", timeout=300, json={
        "model": MODEL, "instructions": "You are Codex, a coding agent.", "input": history,
        "max_output_tokens": 24})
    assert reply.status_code == 200, reply.text
    compacted = reply.json()
    assert compacted["object"] == "response.compaction"
    *kept, summary = compacted["output"]
    assert summary["type"] == "compaction" and summary["encrypted_content"].strip()
    assert kept == [item for item in history if item.get("role") == "user"]
    usage = compacted["usage"]
    assert usage["output_tokens"] > 0 and usage["input_tokens"] > transcript
    assert fresh(usage, "input_tokens_details") <= transcript / 10, (usage, transcript)

    # The next turn starts from the summary: the transcript is not in its prompt.
    after = codex_turn(agent_daemon.url, [*kept, summary, {
        "type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Go on."}]}])
    assert after["usage"]["input_tokens"] < transcript / 4


def test_codex_compaction_trigger_answers_one_compaction_item(agent_daemon, session):
    history = codex_input(session)
    last = codex_turn(agent_daemon.url, history)
    transcript = last["usage"]["input_tokens"]
    history += [item for item in last["output"] if item["type"] == "message"]
    body = {"model": MODEL, "instructions": "You are Codex, a coding agent.", "stream": True,
            "input": [*history, {"type": "compaction_trigger"}], "store": False,
            "max_output_tokens": 24}
    events = []
    with httpx.stream("POST", f"{agent_daemon.url}/v1/responses", json=body,
                      timeout=300) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item["type"] for item in done] == ["compaction"]  # exactly one, as Codex expects
    assert done[0]["encrypted_content"].strip()
    completed = events[-1]
    assert completed["type"] == "response.completed"
    usage = completed["response"]["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert fresh(usage, "input_tokens_details") <= transcript / 10, (usage, transcript)


# ---- the Messages API --------------------------------------------------------------------------
def messages_turn(url: str, body: dict) -> dict:
    reply = httpx.post(f"{url}/v1/messages", timeout=300, json={
        "model": MODEL, "max_tokens": 8, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


def claude_conversation(session: str, results: int = 1) -> list[dict]:
    messages = [{"role": "user", "content": f"Session {session}. Fix the failing handler."}]
    for i in range(results):
        messages += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}",
                                               "name": "Bash",
                                               "input": {"command": f"cat part{i}.py"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                          "content": filler(600 // results)}]}]
    return messages


BASH = {"name": "Bash", "description": "Run a shell command.", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def test_compact_edit_summarises_on_the_cached_conversation(agent_daemon, session):
    messages = claude_conversation(session)
    last = messages_turn(agent_daemon.url, {"messages": messages, "tools": [BASH]})
    transcript = last["usage"]["input_tokens"] + last["usage"]["cache_read_input_tokens"]
    messages += [{"role": "assistant", "content": last["content"]},
                 {"role": "user", "content": "Which handler renders page 7?"}]
    edit = {"type": "compact_20260112", "pause_after_compaction": True,
            "trigger": {"type": "input_tokens", "value": 1000}}
    answer = messages_turn(agent_daemon.url, {
        "messages": messages, "tools": [BASH], "max_tokens": 24,
        "context_management": {"edits": [edit]}})
    assert answer["stop_reason"] == "compaction"
    [block] = answer["content"]
    assert block["type"] == "compaction" and block["content"].strip()
    usage = answer["usage"]
    assert usage["output_tokens"] > 0 and usage["cache_read_input_tokens"] > 0
    assert fresh(usage, "") <= transcript / 10, (usage, transcript)

    # Sent back, the compaction block stands for everything before it.
    after = messages_turn(agent_daemon.url, {"tools": [BASH], "messages": [
        *messages, {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": "Go on."}]})
    assert after["usage"]["input_tokens"] + after["usage"]["cache_read_input_tokens"] \
        < transcript / 4


def test_compact_edit_below_its_trigger_answers_as_usual(agent_daemon, session):
    edit = {"type": "compact_20260112", "trigger": {"type": "input_tokens", "value": 100_000}}
    answer = messages_turn(agent_daemon.url, {
        "messages": [{"role": "user", "content": f"Session {session}. Hi."}], "tools": [BASH],
        "max_tokens": 2, "context_management": {"edits": [edit]}})
    assert all(block["type"] != "compaction" for block in answer["content"])
    assert answer["stop_reason"] in ("end_turn", "max_tokens")
    assert answer["context_management"] == {"applied_edits": []}


def test_clear_tool_uses_keeps_the_last_results(agent_daemon, session):
    messages = claude_conversation(session, results=5)
    whole = httpx.post(f"{agent_daemon.url}/v1/messages/count_tokens", timeout=300, json={
        "model": MODEL, "messages": messages, "tools": [BASH]}).json()["input_tokens"]
    edit = {"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses", "value": 2},
            "trigger": {"type": "input_tokens", "value": 500}}
    answer = messages_turn(agent_daemon.url, {
        "messages": messages, "tools": [BASH], "max_tokens": 1,
        "context_management": {"edits": [edit]}})
    [applied] = answer["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919"
    assert applied["cleared_tool_uses"] == 3
    read = answer["usage"]["input_tokens"] + answer["usage"]["cache_read_input_tokens"]
    assert read == whole - applied["cleared_input_tokens"]
    assert 0.4 * whole < applied["cleared_input_tokens"] < 0.8 * whole  # 3 of 5 results
    bad = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=60, json={
        "model": MODEL, "max_tokens": 1, "messages": messages,
        "context_management": {"edits": [{"type": "clear_everything"}]}})
    assert bad.status_code == 400 and "clear_everything" in bad.json()["error"]["message"]


def test_claude_codes_own_compaction_turn_reads_a_tenth_again(agent_daemon, session):
    """Claude Code compacts with a turn of its own: the conversation as it is, with the
    summarising instruction as the last user message (recorded request, real system prompt)."""
    body = json.loads((FIXTURES / "claude-code-2.1.332-tool-result.json").read_text())["body"]
    body = {**body, "model": MODEL, "stream": False, "max_tokens": 8}
    body["messages"][0]["content"][0]["text"] += f"\nSession {session}."
    last = messages_turn(agent_daemon.url, body)
    transcript = last["usage"]["input_tokens"] + last["usage"]["cache_read_input_tokens"]
    body["messages"] += [
        {"role": "assistant", "content": last["content"]},
        {"role": "user", "content": "Your task is to create a detailed summary of the "
                                    "conversation so far."}]
    summary = messages_turn(agent_daemon.url, body)
    assert summary["usage"]["output_tokens"] > 0
    assert fresh(summary["usage"], "") <= transcript / 10, (summary["usage"], transcript)


def test_a_streamed_compaction_then_answers_from_the_summary(agent_daemon, session):
    """Without pause_after_compaction the answer goes on: the compaction block, then the
    model's answer read from the summary alone; usage counts both generations."""
    body = {"model": MODEL, "max_tokens": 12, "stream": True, "messages": [
        {"role": "user", "content": f"Session {session}. My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"}],
        "context_management": {"edits": [{"type": "compact_20260112",
                                          "trigger": {"type": "input_tokens", "value": 10}}]}}
    with httpx.stream("POST", f"{agent_daemon.url}/v1/messages", json=body,
                      timeout=300) as reply:
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ")]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts[0]["type"] == "compaction" and starts[0]["content"].strip()
    assert [b["type"] for b in starts[1:]] == ["text"]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    assert text.strip()
    [delta] = [e for e in events if e["type"] == "message_delta"]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] > len(text.split())  # the summary's tokens too
    assert delta["context_management"] == {"applied_edits": []}
