"""Tools agents send that used to vanish without a word: Codex's `namespace` tool (its
sub-agent tools) on /v1/responses is offered tool by tool and a call to one comes back named as
the namespace lists it, with the `namespace` beside it; a `defer_loading` tool (Claude Code's
placeholder, Responses' deferred tools) is not rendered into the prompt. Against a real daemon
through the real `openai` and `anthropic` clients, and the translation itself."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from localllm.daemon.api.responses_input import responses_tools

CLOSE = {"type": "function", "name": "close_agent", "description": "Close an agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "target": {"type": "string", "description": "Agent id"}},
             "required": ["target"], "additionalProperties": False}}
NAMESPACE = {"type": "namespace", "name": "multi_agent_v1",
             "description": "Tools for spawning and managing sub-agents.",
             "tools": [CLOSE, {**CLOSE, "name": "spawn_agent", "description": "Start one."}]}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                       "required": ["cmd"]}}


@pytest.fixture(scope="module")
def ai(agent_daemon):
    return openai.OpenAI(base_url=agent_daemon.url + "/v1", api_key="unused", max_retries=0)


def offered(tools) -> list[str]:
    return [t["function"]["name"] for t in tools.tools]


def test_a_namespace_is_flattened_and_a_clash_keeps_the_namespace_in_the_name():
    tools = responses_tools({"tools": [EXEC, NAMESPACE, {"type": "web_search"}]})
    assert offered(tools) == ["exec_command", "close_agent", "spawn_agent"]
    assert tools.namespaced == {"close_agent": ("multi_agent_v1", "close_agent"),
                                "spawn_agent": ("multi_agent_v1", "spawn_agent")}
    clash = responses_tools({"tools": [CLOSE, NAMESPACE]})
    assert offered(clash) == ["close_agent", "multi_agent_v1.close_agent", "spawn_agent"]
    assert clash.offered_name("multi_agent_v1", "close_agent") == "multi_agent_v1.close_agent"
    deferred = responses_tools({"tools": [EXEC, {**CLOSE, "defer_loading": True}]})
    assert offered(deferred) == ["exec_command"]


def test_a_call_to_a_namespaced_tool_comes_back_with_its_namespace(ai):
    r = ai.responses.create(model="smollm2-tools", input="Close agent a1.", temperature=0,
                            tools=[EXEC, NAMESPACE], max_output_tokens=60,
                            tool_choice={"type": "function", "name": "close_agent"})
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1
    assert calls[0].name == "close_agent" and calls[0].namespace == "multi_agent_v1"
    assert "target" in json.loads(calls[0].arguments)
    # Codex sends the call back with its namespace, and the output after it: both are read.
    follow = ai.responses.create(
        model="smollm2-tools", tools=[EXEC, NAMESPACE], max_output_tokens=3, input=[
            {"role": "user", "content": "Close agent a1."},
            {"type": "function_call", "call_id": calls[0].call_id, "name": "close_agent",
             "namespace": "multi_agent_v1", "arguments": calls[0].arguments},
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "closed"}])
    assert follow.status in ("completed", "incomplete")


def test_the_namespaces_tools_are_in_the_prompt(ai):
    def prompt_tokens(tools) -> int:
        return ai.responses.create(model="smollm2-tools", input="hi", tools=tools,
                                   max_output_tokens=1).usage.input_tokens

    assert prompt_tokens([EXEC, NAMESPACE]) > prompt_tokens([EXEC]) + 40


def test_claude_codes_deferred_placeholder_is_not_rendered(agent_daemon):
    client = anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)
    bash = {"name": "Bash", "description": "Run a command.", "input_schema": {
        "type": "object", "properties": {"command": {"type": "string"}}}}
    placeholder = {"name": "DeferredToolPlaceholder", "description": "Reserved placeholder "
                   "that keeps deferred tool loading active; never call this tool.",
                   "input_schema": {"type": "object", "properties": {}},
                   "defer_loading": True}
    ask = [{"role": "user", "content": "hi"}]
    with_it = client.messages.count_tokens(model="smollm2-tools", messages=ask,
                                           tools=[placeholder, bash])
    without = client.messages.count_tokens(model="smollm2-tools", messages=ask, tools=[bash])
    assert with_it.input_tokens == without.input_tokens
