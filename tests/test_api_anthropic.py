"""Anthropic's Messages API (/v1/messages) through the real `anthropic` SDK, against a real
daemon and real llama.cpp: plain and streamed answers, a tool round trip, thinking blocks,
count_tokens and the error shapes Claude Code reads."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "description": "City name"},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "Current time in a timezone",
        "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}},
                         "required": ["timezone"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# This SDK's create() no longer names temperature; the API (and Claude Code) still sends it.
COLD = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(agent_daemon):
    return anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)


def test_a_message_not_streamed(client):
    m = client.messages.create(model="smollm2", max_tokens=12, **COLD,
                               system="You are terse.", messages=ASK)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == "smollm2:latest"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > 10
    again = client.messages.create(model="smollm2", max_tokens=12, **COLD,
                                   system="You are terse.", messages=ASK)
    assert again.content[0].text == m.content[0].text
    # The same prompt again: all but its last token comes from the KV cache.
    assert again.usage.cache_read_input_tokens >= m.usage.input_tokens - 1


def test_a_message_streamed_has_anthropics_event_sequence(client):
    plain = client.messages.create(model="smollm2", max_tokens=12, **COLD,
                                   messages=ASK)
    events = list(client.messages.create(model="smollm2", max_tokens=12, **COLD,
                                         messages=ASK, stream=True))
    kinds = [e.type for e in events if e.type != "ping"]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == plain.stop_reason
    assert delta.usage.output_tokens == plain.usage.output_tokens
    # The SDK's own accumulator reads the same stream into the same message.
    with client.messages.stream(model="smollm2", max_tokens=12, **COLD,
                                messages=ASK) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == plain.content[0].text


def test_stop_sequences_end_the_answer_and_are_named(client):
    plain = client.messages.create(model="smollm2", max_tokens=12, **COLD,
                                   messages=ASK)
    word = plain.content[0].text.split()[1]
    m = client.messages.create(model="smollm2", max_tokens=12, **COLD, messages=ASK,
                               stop_sequences=["zzz-never", word])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text


def check_weather(block) -> None:
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_a_tool_round_trip(client):
    m = client.messages.create(model="smollm2-tools", max_tokens=60, **COLD,
                               messages=ASK, tools=[WEATHER, TIME], tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) >= 1
    check_weather(uses[0])
    history = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "22 degrees and sunny"}]}]
    follow = client.messages.create(model="smollm2-tools", max_tokens=20, **COLD,
                                    messages=history, tools=[WEATHER, TIME])
    assert follow.content and follow.usage.output_tokens > 0
    # The call and its result were rendered into the prompt: it grew past the first one.
    grown = follow.usage.input_tokens + follow.usage.cache_read_input_tokens
    assert grown > m.usage.input_tokens + m.usage.cache_read_input_tokens + 20


def test_a_named_tool_streamed_and_only_one_call_when_asked(client):
    events = list(client.messages.create(
        model="smollm2-tools", max_tokens=60, **COLD, messages=ASK, stream=True,
        tools=[WEATHER, TIME],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}))
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    uses = [b for b in starts if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    arguments = "".join(e.delta.partial_json for e in events
                        if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    jsonschema.validate(json.loads(arguments), WEATHER["input_schema"])
    assert [e for e in events if e.type == "message_delta"][0].delta.stop_reason == "tool_use"


def test_tools_on_a_model_without_a_tool_template_are_a_400(client):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="smollm2", max_tokens=5, messages=ASK, tools=[WEATHER])
    assert "does not support tools" in caught.value.body["error"]["message"]


def test_thinking_blocks_on_a_thinking_model(client):
    m = client.messages.create(model="smollm2-thinking", max_tokens=12, **COLD,
                               messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024})
    # The template opened <think>; SmolLM2 never closes it, so all it says is thinking.
    assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking
    events = list(client.messages.create(
        model="smollm2-thinking", max_tokens=12, **COLD, messages=ASK, stream=True,
        thinking={"type": "enabled", "budget_tokens": 1024}))
    streamed = "".join(e.delta.thinking for e in events if e.type == "content_block_delta")
    assert streamed == m.content[0].thinking
    off = client.messages.create(model="smollm2-thinking", max_tokens=12, **COLD,
                                 messages=ASK, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    # Earlier thinking goes back as a block; a model that cannot think just answers.
    history = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Paris is in France.", "signature": "x"},
        {"type": "text", "text": "Sunny."}]}, {"role": "user", "content": "And Rome?"}]
    plain = client.messages.create(model="smollm2", max_tokens=5, messages=history,
                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert plain.content[0].type == "text"


def test_count_tokens_matches_what_the_answer_reports(client):
    counted = client.messages.count_tokens(model="smollm2-tools", messages=ASK,
                                           system="Be brief.", tools=[WEATHER])
    m = client.messages.create(model="smollm2-tools", max_tokens=1, messages=ASK,
                               system="Be brief.", tools=[WEATHER])
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_missing_max_tokens_is_an_invalid_request_error(agent_daemon):
    reply = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=120, json={
        "model": "smollm2", "messages": ASK})
    assert reply.status_code == 400
    assert reply.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "missing required field 'max_tokens'"}}


def test_an_unknown_model_is_a_not_found_error_naming_it(client):
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=5, messages=ASK)
    error = caught.value.body
    assert error["type"] == "error" and error["error"]["type"] == "not_found_error"
    assert "claude-sonnet-4-5" in error["error"]["message"]


def test_bad_blocks_are_a_400_that_says_where(agent_daemon):
    reply = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=120, json={
        "model": "smollm2", "max_tokens": 5,
        "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]})
    assert reply.status_code == 400
    assert "messages[0].content[0]" in reply.json()["error"]["message"]
    image = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=120, json={
        "model": "smollm2", "max_tokens": 5, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}},
            {"type": "text", "text": "What is this?"}]}]})
    assert image.status_code == 400
    assert "does not support images" in image.json()["error"]["message"]


def test_anthropic_headers_and_ignored_fields_are_accepted(agent_daemon):
    reply = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=120, headers={
        "x-api-key": "anything", "anthropic-version": "2023-06-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14"}, json={
        "model": "smollm2", "max_tokens": 3, "metadata": {"user_id": "u1"},
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][0]["type"] == "text"


def test_pings_while_a_long_prompt_is_read(agent_daemon):
    """The runner reports prompt chunks as it reads them; the stream says ping meanwhile, so a
    client's read timeout does not fire before the first token of a long agent prompt. (The
    SDK drops pings, so the raw stream is read.)"""
    # About 1,200 tokens: more than one chunk of the prompt at the largest chunk (n_batch 512),
    # so that at least one chunk is reported before the first token.
    system = " ".join(f"item{i % 100}" for i in range(400))
    with httpx.stream("POST", f"{agent_daemon.url}/v1/messages", timeout=300, json={
            "model": "smollm2", "max_tokens": 3, "system": system, "messages": ASK,
            "stream": True, "num_ctx": 4096, "temperature": 0}) as reply:
        kinds = [line.removeprefix("event: ") for line in reply.iter_lines()
                 if line.startswith("event: ")]
    assert kinds[0] == "message_start" and "ping" in kinds
    assert kinds.index("ping") < kinds.index("content_block_start")
    assert kinds[-1] == "message_stop"
