"""Tools, structured output, fill-in-the-middle and thinking through the real `ollama`,
`openai` and `langchain-ollama` clients, against a real daemon and real llama.cpp.

Models: SmolLM2 as published, and two copies of it whose metadata carries a Qwen2.5-style tool
template (with FIM token ids) or a Qwen3-style thinking template (tests/chat_models.py).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import jsonschema
import ollama
import openai
import pytest
from chat_models import FIM_PIECES, thinking_model, tool_model
from conftest import import_models
from llama_cpp import Llama

QUICK = {"temperature": 0, "num_predict": 60}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# A pydantic-style schema: $defs, $ref, anyOf with null, enum, required.
PERSON = {
    "$defs": {"Pet": {"type": "object", "title": "Pet",
                      "properties": {"kind": {"enum": ["cat", "dog"], "type": "string"},
                                     "name": {"type": "string"}},
                      "required": ["kind", "name"]}},
    "type": "object", "title": "Person",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                   "pet": {"anyOf": [{"$ref": "#/$defs/Pet"}, {"type": "null"}]}},
    "required": ["name", "age", "pet"],
}


@pytest.fixture(scope="module")
def chat_daemon(tmp_path_factory, smollm2_gguf):
    from daemon_process import isolated_env, start_daemon

    root = tmp_path_factory.mktemp("chat")
    env = isolated_env(root / "home")
    import_models(env, {"smollm2": smollm2_gguf,
                        "smollm2-tools": tool_model(smollm2_gguf, root),
                        "smollm2-thinking": thinking_model(smollm2_gguf, root)})
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oc(chat_daemon):
    return ollama.Client(host=chat_daemon.url)


@pytest.fixture(scope="module")
def ai(chat_daemon):
    return openai.OpenAI(base_url=chat_daemon.url + "/v1", api_key="unused")


def post(daemon, path: str, body, method: str = "POST", raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(daemon.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            text = resp.read().decode()
            return resp.status, text
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def ndjson(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# ---- structured output ---------------------------------------------------------------------
def test_ollama_format_json_and_schema_validate(oc):
    r = oc.chat(model="smollm2", format="json", options=QUICK, messages=[
        {"role": "user", "content": "Reply in JSON: what is the capital of France?"}])
    assert r.done_reason == "stop" and isinstance(json.loads(r.message.content), dict)
    r = oc.chat(model="smollm2", format=PERSON, options={"temperature": 0, "num_predict": 120},
                messages=[{"role": "user", "content": "Invent a person with a pet, as JSON."}])
    jsonschema.validate(json.loads(r.message.content), PERSON)
    parts = list(oc.generate(model="smollm2", prompt="A person with a pet:", format=PERSON,
                             stream=True, options={"temperature": 0.7, "seed": 3,
                                                   "num_predict": 120}))
    jsonschema.validate(json.loads("".join(p.response for p in parts)), PERSON)


def test_openai_json_schema_and_json_object_validate(ai):
    r = ai.chat.completions.create(
        model="smollm2", temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Invent a person with a pet."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = ai.chat.completions.create(model="smollm2", temperature=0, max_tokens=60,
                                   response_format={"type": "json_object"},
                                   messages=[{"role": "user", "content": "Reply in JSON: what "
                                              "is the capital of France?"}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_langchain_structured_output_validates(chat_daemon):
    from langchain_ollama import ChatOllama
    from pydantic import BaseModel

    class Pet(BaseModel):
        kind: str
        name: str

    class Person(BaseModel):
        name: str
        age: int
        pet: Pet | None

    llm = ChatOllama(model="smollm2", base_url=chat_daemon.url, temperature=0, num_predict=120)
    person = llm.with_structured_output(Person).invoke("Invent a person with a pet.")
    assert isinstance(person, Person) and isinstance(person.age, int)


def test_bad_format_is_a_400(chat_daemon):
    code, text = post(chat_daemon, "/api/chat", {"model": "smollm2", "messages": ASK,
                                                 "format": "yaml"})
    assert code == 400 and "invalid format" in json.loads(text)["error"]
    code, text = post(chat_daemon, "/v1/chat/completions", {
        "model": "smollm2", "messages": ASK, "response_format": {"type": "json_schema"}})
    assert code == 400 and "schema" in json.loads(text)["error"]["message"]


# ---- capability refusals on SmolLM2 --------------------------------------------------------
def test_tools_and_fim_get_their_400s_on_smollm2(oc, ai, chat_daemon):
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="smollm2", messages=ASK, tools=[WEATHER])
    assert e.value.status_code == 400 and e.value.error == "smollm2:latest does not support tools"
    with pytest.raises(ollama.ResponseError) as e:
        oc.generate(model="smollm2", prompt="def add(a, b):", suffix="    return c")
    assert e.value.status_code == 400 and "does not support insert" in e.value.error
    with pytest.raises(openai.BadRequestError) as e:
        ai.chat.completions.create(model="smollm2", messages=ASK, tools=[WEATHER])
    assert "does not support tools" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ai.completions.create(model="smollm2", prompt="def add(a, b):", suffix="return c")
    assert "does not support insert" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        oc.chat(model="smollm2", messages=ASK, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    code, text = post(chat_daemon, "/api/chat", {
        "model": "smollm2", "messages": [{"role": "user", "content": "hi", "images": ["AAAA"]}]})
    assert code == 400 and "does not support images" in json.loads(text)["error"]


# ---- tools -----------------------------------------------------------------------------------
def check_weather_call(name: str, arguments: dict) -> None:
    assert name == "get_weather"
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_ollama_forced_tool_call_not_streamed(chat_daemon):
    code, text = post(chat_daemon, "/api/chat", {
        "model": "smollm2-tools", "messages": ASK, "tools": [WEATHER, TIME], "stream": False,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "options": QUICK})
    assert code == 200, text
    message = json.loads(text)["message"]
    calls = message["tool_calls"]
    assert len(calls) == 1 and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["index"] == 0
    check_weather_call(calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    assert "<tool_call>" not in message["content"]


def test_ollama_forced_tool_call_streamed(chat_daemon):
    code, text = post(chat_daemon, "/api/chat", {
        "model": "smollm2-tools", "messages": ASK, "tools": [WEATHER], "stream": True,
        "tool_choice": "required", "options": QUICK})
    assert code == 200
    lines = ndjson(text)
    assert lines[-1]["done"] and not any(line["done"] for line in lines[:-1])
    calls = [c for line in lines for c in line["message"].get("tool_calls", [])]
    assert len(calls) == 1
    check_weather_call(calls[0]["function"]["name"], calls[0]["function"]["arguments"])
    assert "<tool_call>" not in "".join(line["message"]["content"] for line in lines)


def test_ollama_client_reads_the_call_and_sends_the_result_back(oc, chat_daemon):
    code, text = post(chat_daemon, "/api/chat", {
        "model": "smollm2-tools", "messages": ASK, "tools": [WEATHER], "stream": False,
        "tool_choice": "required", "options": QUICK})
    call = json.loads(text)["message"]["tool_calls"][0]
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_name": "get_weather", "content": "22 degrees"}]
    r = oc.chat(model="smollm2-tools", messages=history, tools=[WEATHER],
                options={"temperature": 0, "num_predict": 20})
    assert r.done and r.prompt_eval_count > 0
    assert r.message.content or r.message.tool_calls  # the model answers after the result


def test_openai_forced_tool_call_not_streamed(ai):
    r = ai.chat.completions.create(model="smollm2-tools", messages=ASK, tools=[WEATHER, TIME],
                                   tool_choice={"type": "function",
                                                "function": {"name": "get_weather"}},
                                   temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    check_weather_call(calls[0].function.name, json.loads(calls[0].function.arguments))


def test_openai_forced_tool_call_streamed_with_usage(ai):
    chunks = list(ai.chat.completions.create(
        model="smollm2-tools", messages=ASK, tools=[WEATHER], tool_choice="required",
        temperature=0, max_tokens=60, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in (d.tool_calls or [])]
    assert len(calls) == 1 and calls[0].index == 0
    check_weather_call(calls[0].function.name, json.loads(calls[0].function.arguments))
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens > 0


def test_tool_call_results_render_into_the_next_prompt(ai):
    """An OpenAI history with a call (arguments as a string) and its result is accepted and
    rendered by the template: the prompt grows by the call and the result."""
    call = {"id": "call_abc12345", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    base = ai.chat.completions.create(model="smollm2-tools", messages=ASK, tools=[WEATHER],
                                      max_tokens=1, temperature=0)
    follow = ai.chat.completions.create(
        model="smollm2-tools", tools=[WEATHER], max_tokens=1, temperature=0,
        messages=ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "call_abc12345", "content": "22C"}])
    assert follow.usage.prompt_tokens > base.usage.prompt_tokens + 20


# ---- fill-in-the-middle --------------------------------------------------------------------
def test_fim_uses_the_models_fim_tokens(oc, ai, smollm2_gguf):
    prefix, suffix = "def add(a, b):\n    c = ", "\n    return c\n"
    r = oc.generate(model="smollm2-tools", prompt=prefix, suffix=suffix,
                    options={"temperature": 0, "num_predict": 8})
    vocab = Llama(str(smollm2_gguf), vocab_only=True, verbose=False)
    pre, suf, mid = FIM_PIECES
    expected = vocab.tokenize(f"{pre}{prefix}{suf}{suffix}{mid}".encode(), add_bos=False,
                              special=True)
    assert r.prompt_eval_count <= len(expected)  # a cached prefix is not evaluated again
    done = oc.generate(model="smollm2-tools", prompt=prefix + "x", suffix=suffix,
                       options={"temperature": 0, "num_predict": 1})
    assert done.prompt_eval_count >= 1
    c = ai.completions.create(model="smollm2-tools", prompt=prefix, suffix=suffix,
                              max_tokens=8, temperature=0)
    assert c.usage.prompt_tokens == len(expected)
    assert "insert" in oc.show("smollm2-tools").capabilities


# ---- thinking ------------------------------------------------------------------------------
def test_thinking_is_separate_from_content(oc, ai):
    r = oc.chat(model="smollm2-thinking", messages=ASK,
                options={"temperature": 0, "num_predict": 12})
    # The template opened <think>; SmolLM2 never closes it, so all it says is thinking.
    assert r.message.thinking and r.message.content == ""
    parts = list(oc.chat(model="smollm2-thinking", messages=ASK, stream=True, think="high",
                         options={"temperature": 0, "num_predict": 12}))
    assert "".join(p.message.thinking or "" for p in parts) == r.message.thinking
    off = oc.chat(model="smollm2-thinking", messages=ASK, think=False,
                  options={"temperature": 0, "num_predict": 12})
    assert off.message.content and not off.message.thinking
    o = ai.chat.completions.create(model="smollm2-thinking", messages=ASK, temperature=0,
                                   max_tokens=12)
    assert o.choices[0].message.model_extra["reasoning_content"] == r.message.thinking
    assert oc.show("smollm2-thinking").capabilities == ["completion", "thinking"]


# ---- logprobs ------------------------------------------------------------------------------
def test_openai_logprobs(ai):
    r = ai.chat.completions.create(model="smollm2", messages=ASK, max_tokens=6, temperature=0,
                                   logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # Greedy decoding picks the most likely token.
        assert e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
    chunks = list(ai.completions.create(model="smollm2", prompt="1, 2, 3,", max_tokens=4,
                                        temperature=0, logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert "".join(tokens) == "".join(c.choices[0].text for c in chunks)


def test_ollama_logprobs(chat_daemon):
    body = {"model": "smollm2", "messages": ASK, "logprobs": True, "top_logprobs": 2,
            "options": {"temperature": 0, "num_predict": 5}}
    code, text = post(chat_daemon, "/api/chat", {**body, "stream": False})
    whole = json.loads(text)
    assert code == 200 and len(whole["logprobs"]) == whole["eval_count"]
    assert "".join(e["token"] for e in whole["logprobs"]) == whole["message"]["content"]
    lines = ndjson(post(chat_daemon, "/api/chat", {**body, "stream": True})[1])
    streamed = [e for line in lines for e in line.get("logprobs", [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole["logprobs"]]
    assert all(len(e["top_logprobs"]) == 2 for e in streamed)


def test_format_on_a_thinking_model_turns_thinking_off(oc):
    r = oc.chat(model="smollm2-thinking", format=PERSON,
                options={"temperature": 0, "num_predict": 120},
                messages=[{"role": "user", "content": "Invent a person with a pet."}])
    assert not r.message.thinking
    jsonschema.validate(json.loads(r.message.content), PERSON)
