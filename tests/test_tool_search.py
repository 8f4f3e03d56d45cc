"""Tool search on /v1/messages, run by the server: tools marked `defer_loading` stay out of the
prompt, the search tool is offered instead, and when the model calls it the server runs the
search (regex or BM25), answers with `server_tool_use` and `tool_search_tool_result` blocks and
lets the model go on with the found tools' definitions, appended after the conversation so the
cached prompt before them is reused.

Against a real daemon through the real `anthropic` client. The model is SmolLM2 with a template
that lists the tools as Qwen's does, then shows it four turns of one fixed answer (greedy
decoding repeats it): a call to the search tool until a search result is in the conversation,
then a call to the tool the search found, then a line of text."""

from __future__ import annotations

import json
import uuid

import anthropic
import httpx
import pytest

from localllm.daemon.api.anthropic import anthropic_messages
from localllm.daemon.api.anthropic_search import anthropic_tools, result_block, result_text
from localllm.daemon.chat.parse import ToolCall
from localllm.daemon.chat.tool_search import BadQuery, DeferredTools

SEARCH_TEMPLATE = """\
{%- set ns = namespace(search='', results=[], called=false) %}
{%- for t in tools or [] %}{%- if t.function.name.startswith('tool_search') %}\
{%- set ns.search = t.function.name %}{%- endif %}{%- endfor %}
{{- '<|im_start|>system\\n' + (messages[0].content if messages[0].role == 'system' else '') }}
{%- if tools %}{{- '\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' + (t | tojson) }}\
{%- endfor %}{{- '\\n</tools>' }}{%- endif %}{{- '<|im_end|>\\n' }}
{%- for m in messages %}{%- if m.role == 'user' %}\
{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + m.content }}\
{%- for c in m.tool_calls or [] %}{%- if c.function.name == 'get_weather' %}\
{%- set ns.called = true %}{%- endif %}\
{{- '<tool_call>\\n{"name": "' + c.function.name + '", "arguments": ' }}\
{{- (c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}{%- set ns.results = ns.results + [m.content] %}\
{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}{%- endfor %}
{%- if ns.search and not ns.results %}{%- set want = '<tool_call>\\n{"name": "' + ns.search + \
'", "arguments": {"query": "weather"}}\\n</tool_call>' %}
{%- elif ns.results and '"get_weather"' in ns.results[-1] and not ns.called %}\
{%- set want = '<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}' + \
'\\n</tool_call>' %}
{%- else %}{%- set want = 'It is sunny.' %}{%- endif %}
{%- for i in range(4) %}\
{{- '<|im_start|>user\\nGo.<|im_end|>\\n<|im_start|>assistant\\n' + want + '<|im_end|>\\n' }}\
{%- endfor %}
{{- '<|im_start|>user\\nGo.<|im_end|>\\n' }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
MODEL = "smollm2-search"
SEARCH = {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}
BM25_SEARCH = {"type": "tool_search_tool_bm25_20251119", "name": "tool_search_tool_bm25"}
WEATHER = {"name": "get_weather", "description": "Get the current weather for a city.",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "description": "The city"}}, "required": ["city"]}}
AREAS = ["ticket", "invoice", "calendar", "repository", "channel", "database", "customer",
         "deployment", "document", "spreadsheet"]
VERBS = ["create", "update", "delete", "list", "archive", "export", "assign", "search",
         "comment_on"]


def many_tools(n: int = 99) -> list[dict]:
    """An agent's MCP tools: `n` tools over ten areas, plus get_weather (n + 1 in all)."""
    tools = []
    for i in range(n):
        area, verb = AREAS[i % len(AREAS)], VERBS[i // len(AREAS) % len(VERBS)]
        tools.append({"name": f"mcp__work__{verb}_{area}_{i}",
                      "description": f"{verb.replace('_', ' ').capitalize()} a {area} in the "
                                     f"team's workspace and return its new state as JSON.",
                      "input_schema": {"type": "object", "properties": {
                          f"{area}_id": {"type": "string", "description": f"The {area}'s id"},
                          "note": {"type": "string", "description": "Why, for the log"}},
                          "required": [f"{area}_id"]}})
    return [*tools[:50], WEATHER, *tools[50:]]


def deferred(tools: list[dict]) -> list[dict]:
    return [{**t, "defer_loading": True} for t in tools]


# ---- the index -------------------------------------------------------------------------------
def index() -> DeferredTools:
    return anthropic_tools({"tools": [SEARCH, *deferred(many_tools())]}).deferred


def test_deferred_tools_are_indexed_and_the_search_tool_offered():
    tools = anthropic_tools({"tools": [SEARCH, *deferred(many_tools()), {"name": "Bash"}]})
    assert [t["function"]["name"] for t in tools.offered] == ["tool_search_tool_regex", "Bash"]
    assert tools.searches == {"tool_search_tool_regex": "regex"}
    assert len(tools.deferred.tools) == 100


def test_regex_searches_names_descriptions_and_parameter_names():
    tools = index()
    assert tools.regex("weather") == ["get_weather"]
    assert tools.regex("(?i)CITY") == ["get_weather"]  # a parameter's name
    assert tools.regex("^mcp__work__archive_invoice") == ["mcp__work__archive_invoice_41"]
    assert len(tools.regex("invoice")) == 5  # at most five, in the tools' order
    with pytest.raises(BadQuery, match="regular expression"):
        tools.regex("(unclosed")
    with pytest.raises(BadQuery, match="at most 200"):
        tools.regex("a" * 201)


def test_bm25_ranks_by_keywords():
    tools = index()
    assert tools.bm25("weather in a city")[0] == "get_weather"
    found = tools.bm25("archive an invoice")
    assert found[0] == "mcp__work__archive_invoice_41"
    assert all("invoice" in name or "archive" in name for name in found)
    assert tools.bm25("zebra") == []


def test_search_blocks_sent_back_are_read_as_the_call_and_the_tools_found():
    body = {"tools": [SEARCH, *deferred(many_tools())], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "tool_search_tool_regex",
             "input": {"query": "weather"}},
            {"type": "tool_search_tool_result", "tool_use_id": "srvtoolu_1", "content": {
                "type": "tool_search_tool_search_result",
                "tool_references": [{"type": "tool_reference", "tool_name": "get_weather"}]}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": "sunny"}]}]}
    user, call, found, weather, result = anthropic_messages(body)
    assert call["tool_calls"][0]["function"] == {"name": "tool_search_tool_regex",
                                                 "arguments": {"query": "weather"}}
    assert found["role"] == "tool" and found["tool_call_id"] == "srvtoolu_1"
    definition = json.loads(found["content"].splitlines()[1])
    assert definition["function"]["name"] == "get_weather"
    assert definition["function"]["parameters"] == WEATHER["input_schema"]
    assert weather["tool_calls"][0]["function"]["name"] == "get_weather"
    assert result == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_2",
                      "name": "get_weather"}


def test_a_tool_reference_in_a_tool_result_brings_the_tools_definition():
    """Claude Code's own ToolSearch tool answers with tool_reference blocks."""
    body = {"tools": [{"name": "ToolSearch"}, *deferred(many_tools())], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "ToolSearch", "input": {"query": "w"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "tool_reference",
                                                   "tool_name": "get_weather"}]}]}]}
    result = anthropic_messages(body)[-1]
    assert '"name": "get_weather"' in result["content"]
    assert "Get the current weather" in result["content"]


async def test_a_bad_pattern_is_an_error_result_the_model_reads():
    """A regular expression that does not compile answers the search with an error block, and
    the model reads the error as the call's result."""
    tools = anthropic_tools({"tools": [SEARCH, *deferred(many_tools())]})
    block = await result_block(ToolCall("tool_search_tool_regex", {"query": "(x"}, "call_1", 0),
                         "regex", tools.deferred)
    assert block["content"]["type"] == "tool_search_tool_result_error"
    assert block["content"]["error_code"] == "invalid_tool_input"
    assert result_text(block, tools.deferred).startswith("Error: the pattern is not")


async def test_a_backtracking_pattern_is_stopped_and_reported():
    """`(a+)+b` over a 40-letter description backtracks for hours in Python's `re`: the search
    runs in a worker that is killed at its time limit, and the model reads why."""
    tools = anthropic_tools({"tools": [SEARCH, *deferred(
        [{"name": "spin", "description": "a" * 40, "input_schema": {"type": "object"}}])]})
    block = await result_block(ToolCall("tool_search_tool_regex", {"query": "(a+)+b"},
                                        "call_1", 0), "regex", tools.deferred)
    assert block["content"]["type"] == "tool_search_tool_result_error", block
    assert "took too long" in block["content"]["error_message"]
    assert tools.deferred.regex("a{40}") == ["spin"]  # the next search gets a fresh worker


# ---- through the daemon ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(agent_daemon):
    reply = httpx.post(f"{agent_daemon.url}/api/create", timeout=120, json={
        "model": MODEL, "from": "smollm2", "template": SEARCH_TEMPLATE,
        "parameters": {"temperature": 0}, "stream": False})
    assert reply.status_code == 200, reply.text
    return anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)


ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def system_prompt() -> str:
    """A system prompt of its own for each test (nothing of it cached before), a few hundred
    tokens long as an agent's is."""
    rules = " ".join(f"Rule {i}: keep answers short, check facts, and use tools when the "
                     f"question needs live data." for i in range(25))
    return f"Session {uuid.uuid4().hex}. You are a helpful agent. {rules}"


def test_deferred_tools_cost_a_tenth_of_the_tokens(client):
    tools = many_tools()
    system = "You are a helpful agent."
    rendered = client.messages.count_tokens(model=MODEL, system=system, messages=ASK,
                                            tools=tools).input_tokens
    answer = client.messages.create(model=MODEL, system=system, messages=ASK, max_tokens=1,
                                    tools=[SEARCH, *deferred(tools)])
    read = answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    assert read <= rendered / 10, (read, rendered)
    assert read == client.messages.count_tokens(model=MODEL, system=system, messages=ASK,
                                                tools=[SEARCH, *deferred(tools)]).input_tokens


def test_a_search_call_is_run_and_the_model_calls_the_tool_it_found(client):
    tools = [SEARCH, *deferred(many_tools())]
    system = system_prompt()
    first = client.messages.count_tokens(model=MODEL, system=system, messages=ASK,
                                         tools=tools).input_tokens
    answer = client.messages.create(model=MODEL, system=system, messages=ASK, max_tokens=60,
                                    tools=tools)
    kinds = [block.type for block in answer.content]
    assert kinds == ["server_tool_use", "tool_search_tool_result", "tool_use"], answer.content
    use, result, call = answer.content
    assert use.name == "tool_search_tool_regex" and use.input == {"query": "weather"}
    assert result.tool_use_id == use.id
    assert [r.tool_name for r in result.content.tool_references] == ["get_weather"]
    assert call.name == "get_weather" and call.input == {"city": "Paris"}
    assert answer.stop_reason == "tool_use"
    # The found tool came after the conversation: the second generation reused the cached
    # prompt of the first (the system prompt, its tools and the question; nothing had cached
    # them before) and read afresh only what came after (the call, the result and the
    # template's four examples of the answer, about 300 tokens).
    again = answer.usage.input_tokens - first
    assert answer.usage.cache_read_input_tokens >= 0.75 * first, (answer.usage, first)
    assert again <= first / 2, (answer.usage, first)

    # The client runs get_weather and sends everything back: the model answers, and the
    # prompt up to the search's result is read from the cache.
    follow = client.messages.create(
        model=MODEL, system=system, max_tokens=20, tools=tools, messages=[
            *ASK, {"role": "assistant", "content": [b.model_dump() for b in answer.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                          "content": "sunny, 24 C"}]}])
    assert follow.content[0].type == "text" and "sunny" in follow.content[0].text
    assert follow.stop_reason == "end_turn"
    assert follow.usage.cache_read_input_tokens >= answer.usage.cache_read_input_tokens
    assert follow.usage.input_tokens < follow.usage.cache_read_input_tokens / 4


def test_a_streamed_search_sends_the_blocks_as_anthropic_does(client):
    with client.messages.stream(model=MODEL, system=system_prompt(), messages=ASK,
                                max_tokens=60, tools=[BM25_SEARCH, *deferred(many_tools())]
                                ) as stream:
        events = [(e.type, getattr(e, "content_block", None)) for e in stream]
        final = stream.get_final_message()
    started = [block.type for kind, block in events if kind == "content_block_start"]
    assert started == ["server_tool_use", "tool_search_tool_result", "tool_use"], events
    assert [b.type for b in final.content] == started
    assert final.content[0].input == {"query": "weather"}  # BM25 over the same words
    assert final.content[1].content.tool_references[0].tool_name == "get_weather"
    assert final.content[2].name == "get_weather"
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0
