"""`max_tokens` is a ceiling, not a reservation: a prompt that fits the loaded context is read
and the answer stops at the context's end with each API's own stop reason (agents ask for
32000 on every request). A prompt that does not fit is a 400 that says its size, the
context's and what to do. And the limits and items the APIs refuse (`max_tokens` 0 or -1, a
tool result answering no call, an unknown `truncation`) are 400s in each API's own shape.
Real daemon, real llama.cpp, the real `anthropic`, `openai` and `ollama` clients."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest

N_CTX = 512  # loaded for these tests: a prompt of about 340 tokens fits, with little room
FILLER = " ".join(f"Note {i}: the numbers below are counted one by one." for i in range(22))
COUNT = "Count from 1 to 500, separated by commas: 1, 2, 3, 4, 5, 6,"
AGENT_MAX = 32000  # what Claude Code and Qwen Code send as max_tokens


@pytest.fixture(scope="module")
def claude(agent_daemon):
    return anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ai(agent_daemon):
    return openai.OpenAI(base_url=agent_daemon.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oc(agent_daemon):
    return ollama.Client(host=agent_daemon.url)


SMALL = {"num_ctx": N_CTX, "temperature": 0}  # table options, taken as top-level fields


# ---- a ceiling -----------------------------------------------------------------------------
def test_anthropic_max_tokens_past_the_context_is_cut_at_its_end(claude):
    # Streamed, as Claude Code asks (the SDK streams any request of this max_tokens).
    with claude.messages.stream(model="smollm2", max_tokens=AGENT_MAX, system=FILLER,
                                messages=[{"role": "user", "content": COUNT}],
                                extra_body=SMALL) as stream:
        m = stream.get_final_message()
    read = m.usage.input_tokens + m.usage.cache_read_input_tokens
    assert N_CTX // 2 < read < N_CTX  # more than the old reservation (half) let through
    assert m.stop_reason == "max_tokens"
    assert read + m.usage.output_tokens >= N_CTX - 1  # it ran to the context's end


def test_openai_chat_max_tokens_past_the_context_is_cut_at_its_end(ai):
    r = ai.chat.completions.create(model="smollm2", max_tokens=AGENT_MAX, extra_body=SMALL,
                                   messages=[{"role": "system", "content": FILLER},
                                             {"role": "user", "content": COUNT}])
    assert r.choices[0].finish_reason == "length"
    assert N_CTX // 2 < r.usage.prompt_tokens < N_CTX
    assert r.usage.prompt_tokens + r.usage.completion_tokens >= N_CTX - 1


def test_responses_max_output_tokens_past_the_context_is_cut_at_its_end(ai):
    r = ai.responses.create(model="smollm2", max_output_tokens=AGENT_MAX, instructions=FILLER,
                            input=COUNT, extra_body=SMALL)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens + r.usage.output_tokens >= N_CTX - 1


def test_ollama_num_predict_past_the_context_is_cut_at_its_end(oc):
    # Another system prompt than the tests above: its prompt is read afresh (prompt_eval_count
    # counts only what was not reused).
    r = oc.chat(model="smollm2", messages=[{"role": "system", "content": "Ollama. " + FILLER},
                                           {"role": "user", "content": COUNT}],
                options={**SMALL, "num_predict": AGENT_MAX})
    assert r.done_reason == "length"
    assert r.prompt_eval_count + r.eval_count >= N_CTX - 1


def test_a_prompt_past_the_context_is_a_400_saying_sizes_and_what_to_do(claude, ai):
    long = FILLER + " " + FILLER
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smollm2", max_tokens=AGENT_MAX, system=long, stream=True,
                               messages=[{"role": "user", "content": COUNT}], extra_body=SMALL)
    message = e.value.body["error"]["message"]
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert f"the loaded context holds {N_CTX}" in message
    tokens = int(message.split(" tokens")[0].split()[-1])
    assert tokens > N_CTX  # its own size, counted
    assert "larger num_ctx (it was trained on 8192 tokens)" in message
    # Truncation off: the same, for the whole prompt.
    with pytest.raises(openai.BadRequestError) as e:
        ai.responses.create(model="smollm2", max_output_tokens=AGENT_MAX, instructions=long,
                            input=COUNT, truncation="disabled", extra_body=SMALL)
    assert f"the loaded context holds {N_CTX}" in e.value.body["message"]


# ---- what the APIs refuse ------------------------------------------------------------------
def _post(daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(daemon.url + path, json=body, timeout=120)


@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_anthropic_max_tokens_below_one_is_an_invalid_request_error(agent_daemon, value):
    r = _post(agent_daemon, "/v1/messages", {"model": "smollm2", "max_tokens": value,
                                             "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "'max_tokens' must be an integer of at least 1" in r.json()["error"]["message"]


def test_an_anthropic_tool_result_answering_no_tool_use_is_a_400(agent_daemon):
    r = _post(agent_daemon, "/v1/messages", {"model": "smollm2-tools", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": [
                                                 {"type": "tool_result",
                                                  "tool_use_id": "toolu_nowhere",
                                                  "content": "42"}]}]})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "toolu_nowhere" in r.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [("max_tokens", 0), ("max_tokens", -1),
                                         ("max_completion_tokens", 0)])
def test_openai_chat_limits_below_one_are_openai_errors(agent_daemon, field, value):
    r = _post(agent_daemon, "/v1/chat/completions", {
        "model": "smollm2", field: value, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == field
    assert f"'{field}' must be an integer of at least 1" in error["message"]


def test_completions_take_max_tokens_0_to_score_a_prompt_but_not_minus_1(agent_daemon):
    scored = _post(agent_daemon, "/v1/completions", {"model": "smollm2", "prompt": "Hi there",
                                                     "max_tokens": 0, "echo": True})
    assert scored.status_code == 200, scored.text
    r = _post(agent_daemon, "/v1/completions", {"model": "smollm2", "prompt": "Hi",
                                                "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("body,fragment", [
    ({"max_output_tokens": 0}, "'max_output_tokens' must be an integer of at least 1"),
    ({"max_output_tokens": -1}, "'max_output_tokens' must be an integer of at least 1"),
    ({"truncation": "sometimes"}, "truncation must be 'auto' or 'disabled'"),
    ({"input": [{"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "call_nowhere", "output": "42"}]},
     "call_nowhere"),
])
def test_responses_refusals_are_openai_errors(agent_daemon, body, fragment):
    r = _post(agent_daemon, "/v1/responses", {"model": "smollm2-tools", "input": "hi", **body})
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert fragment in r.json()["error"]["message"]


def test_a_call_output_may_answer_the_previous_responses_call(ai):
    weather = {"type": "function", "name": "get_weather", "description": "Weather in a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}
    first = ai.responses.create(model="smollm2-tools", input="Weather in Paris?",
                                tools=[weather], tool_choice="required", temperature=0,
                                max_output_tokens=40)
    call = next(item for item in first.output if item.type == "function_call")
    follow = ai.responses.create(model="smollm2-tools", previous_response_id=first.id,
                                 tools=[weather], max_output_tokens=4, input=[
                                     {"type": "function_call_output", "call_id": call.call_id,
                                      "output": "sunny"}])
    assert follow.status in ("completed", "incomplete")
