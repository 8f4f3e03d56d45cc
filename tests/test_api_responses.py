"""OpenAI's Responses API (/v1/responses) through the real `openai` SDK, against a real daemon
and real llama.cpp: plain and streamed answers, a function round trip, custom and hosted tools,
previous_response_id chains and structured output."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "description": "City name"},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Apply a patch to files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}
ASK = "What is the weather in Paris?"
COLD = {"temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def ai(agent_daemon):
    return openai.OpenAI(base_url=agent_daemon.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_not_streamed(ai):
    r = ai.responses.create(model="smollm2", input=ASK, instructions="Be terse.", **COLD)
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert [item.type for item in r.output] == ["message"] and r.output_text
    assert r.usage.output_tokens > 0 and r.usage.input_tokens > 10
    again = ai.responses.create(model="smollm2", input=ASK, instructions="Be terse.", **COLD)
    assert again.output_text == r.output_text
    assert again.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 1
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_a_response_streamed_has_the_responses_event_sequence(ai):
    plain = ai.responses.create(model="smollm2", input=ASK, **COLD)
    events = list(ai.responses.create(model="smollm2", input=ASK, stream=True, **COLD))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert events[-1].response.status == plain.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    assert events[-1].response.output_text == plain.output_text
    # The SDK's own accumulator reads the same stream into the same response.
    with ai.responses.stream(model="smollm2", input=ASK, **COLD) as stream:
        final = stream.get_final_response()
    assert final.output_text == plain.output_text


def test_a_function_round_trip(ai):
    r = ai.responses.create(model="smollm2-tools", input=ASK, tools=[WEATHER],
                            tool_choice="required", temperature=0, max_output_tokens=60)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    follow = ai.responses.create(
        model="smollm2-tools", tools=[WEATHER], temperature=0, max_output_tokens=20,
        input=[{"role": "user", "content": ASK},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "22 degrees and sunny"}])
    assert follow.output and follow.usage.output_tokens > 0
    assert follow.usage.input_tokens > r.usage.input_tokens + 20  # the call and result rendered


def test_a_streamed_function_call(ai):
    events = list(ai.responses.create(model="smollm2-tools", input=ASK, tools=[WEATHER],
                                      tool_choice={"type": "function", "name": "get_weather"},
                                      temperature=0, max_output_tokens=60, stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])
    assert events[-1].response.output[-1].type == "function_call"


def test_custom_and_hosted_tools_are_accepted(ai, agent_daemon):
    r = ai.responses.create(model="smollm2-tools", input="Fix the typo in README.md",
                            tools=[PATCH, {"type": "web_search"}], tool_choice="required",
                            temperature=0, max_output_tokens=40)
    calls = [item for item in r.output if item.type == "custom_tool_call"]
    assert len(calls) == 1 and calls[0].name == "apply_patch"
    assert isinstance(calls[0].input, str) and calls[0].call_id.startswith("call_")
    # Its output goes back as a custom_tool_call_output; hosted items in the input are skipped.
    follow = ai.responses.create(
        model="smollm2-tools", tools=[PATCH, {"type": "web_search"}], max_output_tokens=5,
        input=[{"role": "user", "content": "Fix the typo"},
               {"type": "custom_tool_call", "call_id": calls[0].call_id,
                "name": "apply_patch", "input": calls[0].input},
               {"type": "custom_tool_call_output", "call_id": calls[0].call_id,
                "output": "Done!"}])
    assert follow.status in ("completed", "incomplete")
    # A model without a tool template still answers when only hosted tools are offered.
    reply = httpx.post(f"{agent_daemon.url}/v1/responses", timeout=120, json={
        "model": "smollm2", "input": "hi", "max_output_tokens": 3,
        "tools": [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["v"]},
                  {"type": "code_interpreter", "container": {"type": "auto"}}]})
    assert reply.status_code == 200, reply.text


def test_a_previous_response_id_chain(ai):
    first = ai.responses.create(model="smollm2", input="My name is Ada.", **COLD)
    second = ai.responses.create(model="smollm2", input="What is my name?",
                                 previous_response_id=first.id, **COLD)
    assert second.previous_response_id == first.id
    # The first turn (question and answer) is in the second prompt, read from the cache.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
    assert ai.responses.retrieve(second.id).output_text == second.output_text
    unstored = ai.responses.create(model="smollm2", input="hi", store=False, **COLD)
    with pytest.raises(openai.NotFoundError) as caught:
        ai.responses.create(model="smollm2", input="again", previous_response_id=unstored.id,
                            **COLD)
    assert unstored.id in caught.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        ai.responses.retrieve("resp_dropped")


def test_stored_responses_are_bounded():
    from localllm.daemon.api.responses import StoredResponses

    stored = StoredResponses(max_count=3, max_bytes=1 << 20)
    for i in range(5):
        stored.put({"id": f"resp_{i}"}, ({"role": "user", "content": "x"},))
    assert list(stored.items) == ["resp_2", "resp_3", "resp_4"]
    small = StoredResponses(max_count=100, max_bytes=1000)
    for i in range(5):
        small.put({"id": f"resp_{i}"}, ({"role": "user", "content": "x" * 400},))
    assert list(small.items) == ["resp_3", "resp_4"] and small.size <= 1000
    with pytest.raises(Exception, match="dropped"):
        small.get("resp_0")


def test_json_schema_format_validates(ai):
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = ai.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=60,
                            text={"format": {"type": "json_schema", "name": "weather",
                                             "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)
    j = ai.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=60,
                            text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(j.output_text), dict)


def test_reasoning_items_on_a_thinking_model(ai):
    r = ai.responses.create(model="smollm2-thinking", input=ASK, reasoning={"effort": "high"},
                            **COLD)
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text
    events = list(ai.responses.create(model="smollm2-thinking", input=ASK, stream=True,
                                      reasoning={"effort": "high"}, **COLD))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == r.output[0].content[0].text
    off = ai.responses.create(model="smollm2-thinking", input=ASK, reasoning={"effort": "none"},
                              **COLD)
    assert [item.type for item in off.output] == ["message"]
    # An effort sent to a model that cannot think is no error: Codex always sends one.
    plain = ai.responses.create(model="smollm2", input=ASK, reasoning={"effort": "medium"},
                                **COLD)
    assert plain.output[0].type == "message"


def test_an_unknown_model_is_a_404_naming_it(ai):
    with pytest.raises(openai.NotFoundError) as caught:
        ai.responses.create(model="gpt-5-codex", input="hi")
    assert "gpt-5-codex" in caught.value.body["message"]
    assert caught.value.body["code"] == "model_not_found"
