"""Odd `context_management` shapes on /v1/messages are a 400 naming the field, never a 500
(issue 68, item 6): each through a real daemon, with a trigger of 0 so that an edit that got
past the check would be applied."""

from __future__ import annotations

import httpx
import pytest

MODEL = "smollm2-tools"
CLEAR = "clear_tool_uses_20250919"
COMPACT = "compact_20260112"
ZERO = {"type": "input_tokens", "value": 0}

ODD = {
    "type as a list": {"type": [CLEAR]},
    "type as an object": {"type": {"name": CLEAR}},
    "exclude_tools as a number": {"type": CLEAR, "trigger": ZERO, "exclude_tools": 5},
    "exclude_tools of objects": {"type": CLEAR, "trigger": ZERO, "exclude_tools": [{}]},
    "keep as text": {"type": CLEAR, "trigger": ZERO, "keep": {"type": "tool_uses",
                                                              "value": "2"}},
    "keep as a list": {"type": CLEAR, "trigger": ZERO, "keep": [2]},
    "clear_at_least negative": {"type": CLEAR, "trigger": ZERO,
                                "clear_at_least": {"type": "input_tokens", "value": -1}},
    "instructions as an object": {"type": COMPACT, "trigger": ZERO, "instructions": {"a": 1}},
    "trigger as a list": {"type": COMPACT, "trigger": [ZERO]},
}


@pytest.mark.parametrize("case", sorted(ODD))
def test_an_odd_context_management_shape_is_a_400(agent_daemon, case):
    messages = [
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "bash",
                                           "input": {"cmd": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": "a.py b.py"}]}]
    reply = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=120, json={
        "model": MODEL, "max_tokens": 1, "messages": messages,
        "context_management": {"edits": [ODD[case]]}})
    assert reply.status_code == 400, reply.text
    assert "context_management" in reply.json()["error"]["message"]
