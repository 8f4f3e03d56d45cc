"""The one option table: every parser takes each option with the same bounds and gives the same
message for a value out of them; load options at their "auto" value, or a value the planner
capped, never reload a loaded model."""

from __future__ import annotations

import argparse

import httpx
import ollama
import openai
import pytest

from localllm.cli.run import option_flag
from localllm.daemon.api.common import ApiError
from localllm.daemon.api.ollama import ollama_options
from localllm.daemon.api.openai import openai_options
from localllm.modelstore.custom import ModelfileError, parameter_value
from localllm.options import OPTIONS, LoadOptions, OptionError, check, parse
from localllm.tui.slash import SlashError, parse_parameter

NUMERIC = [o for o in OPTIONS.values() if o.kind in (int, float)]


def _message(call) -> str:
    try:
        call()
    except (ApiError, ModelfileError, SlashError, OptionError, argparse.ArgumentTypeError) as e:
        return getattr(e, "message", None) or str(e)
    raise AssertionError("accepted a value out of bounds")


def _parsers(name: str):
    """Each parser of an option, as a function of the JSON value (text parsers get its text)."""
    yield "ollama", lambda v: ollama_options({"options": {name: v}})
    yield "openai", lambda v: openai_options({name: v})
    yield "modelfile json", lambda v: parameter_value(name, v)
    yield "modelfile text", lambda v: parameter_value(name, str(v))
    yield "/set parameter", lambda v: parse_parameter(name, [str(v)])
    yield "run flag", lambda v: option_flag(name)(str(v))


@pytest.mark.parametrize("option", NUMERIC, ids=lambda o: o.name)
def test_every_parser_takes_the_same_bounds_and_says_the_same_when_out_of_them(option):
    inside = [b for b in (option.low, option.high) if b is not None]
    kind = option.kind
    outside = []
    if option.low is not None:
        outside.append(kind(option.low) - (1 if kind is int else 0.5))
    if option.high is not None:
        outside.append(kind(option.high) + (1 if kind is int else 0.5))
    assert outside, f"{option.name} has no bounds"
    for where, parse_one in _parsers(option.name):
        for value in inside:
            parse_one(kind(value))  # accepted at each bound
        for value in outside:
            expected = str(_exception(lambda v=value: check(option.name, v)))
            assert _message(lambda v=value, p=parse_one: p(v)) == expected, where


def _exception(call) -> Exception:
    try:
        call()
    except OptionError as e:
        return e
    raise AssertionError("no error")


def test_auto_values_mean_the_tuner_decides():
    _, load = parse({"num_gpu": -1, "num_thread": 0, "num_batch": -1})
    assert load == LoadOptions()
    _, load = parse({"num_gpu": 0, "num_thread": 2, "num_ctx": 2048, "speculative": "mtp"})
    assert load == LoadOptions(num_ctx=2048, num_gpu=0, num_thread=2, speculative="mtp")
    sampling, load = parse({"speculative": "lookup", "temperature": 0})
    assert sampling.speculative == "lookup" and sampling.temperature == 0.0
    assert load == LoadOptions()  # lookup needs nothing loaded


def test_threads_past_ggmls_limit_are_refused_not_passed_to_the_runner():
    assert "num_thread must be between -1 and 512" in _message(
        lambda: ollama_options({"options": {"num_thread": 1_000_000}}))


def _pid(daemon) -> int:
    models = daemon.get("/api/ps")["models"]
    assert len(models) == 1
    return models[0]["runner_pid"]


def test_auto_load_options_and_a_capped_num_ctx_never_reload(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    oai = openai.OpenAI(base_url=f"{fresh_daemon.url}/v1", api_key="x")
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 1})
    pid = _pid(fresh_daemon)
    autos = {"num_gpu": -1, "num_thread": 0, "num_batch": 0}
    for name, value in [*autos.items(), ("num_thread", -1), ("num_batch", -1)]:
        reply = client.generate(model="smollm2", prompt="hi",
                                options={"num_predict": 1, name: value})
        assert reply.load_duration == 0, f"{name}: {value} reloaded the model"
        oai.chat.completions.create(model="smollm2", max_tokens=1,
                                    messages=[{"role": "user", "content": "hi"}],
                                    extra_body={name: value})
        assert _pid(fresh_daemon) == pid, f"{name}: {value} over OpenAI reloaded the model"
    client.chat(model="smollm2", messages=[{"role": "user", "content": "hi"}],
                options={"num_predict": 1, **autos})
    assert _pid(fresh_daemon) == pid

    # SmolLM2 was trained at 8192: a larger num_ctx is capped, and asking again keeps it.
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 1, "num_ctx": 100000})
    capped = fresh_daemon.get("/api/ps")["models"][0]
    assert capped["context_length"] < 100000
    for _ in range(2):
        reply = client.generate(model="smollm2", prompt="hi",
                                options={"num_predict": 1, "num_ctx": 100000})
        assert reply.load_duration == 0, "a capped num_ctx reloaded the model"
    assert _pid(fresh_daemon) == capped["runner_pid"]


def test_an_out_of_range_value_is_the_same_400_on_every_api(daemon):
    expected = "temperature must be between 0 and 100, not 101"
    replies = [
        httpx.post(f"{daemon.url}/api/chat", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "options": {"temperature": 101}}),
        httpx.post(f"{daemon.url}/api/generate", json={
            "model": "smollm2", "prompt": "hi", "options": {"temperature": 101}}),
        httpx.post(f"{daemon.url}/v1/chat/completions", json={
            "model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "temperature": 101}),
        httpx.post(f"{daemon.url}/v1/completions", json={
            "model": "smollm2", "prompt": "hi", "temperature": 101}),
        httpx.post(f"{daemon.url}/v1/messages", timeout=120, json={
            "model": "smollm2", "max_tokens": 5, "temperature": 101,
            "messages": [{"role": "user", "content": "hi"}]}),
        httpx.post(f"{daemon.url}/v1/responses", timeout=120, json={
            "model": "smollm2", "input": "hi", "temperature": 101}),
        httpx.post(f"{daemon.url}/api/create", json={
            "model": "too-hot", "modelfile": "FROM smollm2\nPARAMETER temperature 101"}),
    ]
    for reply in replies:
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert (error["message"] if isinstance(error, dict) else error) == expected
    # OpenAI's answer limits are whole numbers of at least 1 (0 on completions, which scores
    # the prompt):
    # Ollama's -1 ("no limit") and -2 are num_predict's, not theirs (#39 item 12)
    assert httpx.post(f"{daemon.url}/v1/completions", json={
        "model": "smollm2", "prompt": "hi", "max_tokens": -5}).json()["error"]["message"] == \
        "field 'max_tokens' must be an integer of at least 0; got -5"
    assert httpx.post(f"{daemon.url}/v1/responses", json={
        "model": "smollm2", "input": "hi", "max_output_tokens": -5}).json()["error"]["message"] \
        == "field 'max_output_tokens' must be an integer of at least 1; got -5"
