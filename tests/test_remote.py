"""Remote models: a second real localllm daemon as the OpenAI-compatible upstream (and a real
aiohttp server scripted as one), reached through the first with the official `ollama`,
`openai` and `anthropic` clients and `localllm run`."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

import anthropic
import ollama
import openai
import pytest
from aiohttp import web
from conftest import import_models
from daemon_process import isolated_env, start_daemon, wait_for

GREEDY = {"num_predict": 16, "temperature": 0}
HELLO = [{"role": "user", "content": "Say hello in five words."}]


@pytest.fixture
def upstream(tmp_path_factory, smollm2_gguf):
    # A short path (a socket path has 107 bytes); a small context bounds every answer, as
    # `localllm run` sets no num_predict.
    env = isolated_env(tmp_path_factory.mktemp("up"), LOCALLLM_CONTEXT_LENGTH="512")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.fixture
def proxy(tmp_path_factory):
    """A daemon with no model file at all, only remote entries."""
    d = start_daemon(isolated_env(tmp_path_factory.mktemp("px")))
    yield d
    d.stop()


def add_remote(proxy, name: str, url: str, model: str = "smollm2") -> None:
    done = proxy.cli("remote", "add", name, "--url", url, "--model", model)
    assert done.returncode == 0, done.stderr
    assert f"added {name}:latest" in done.stdout


def post(daemon, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_remote_model_answers_through_both_clients(upstream, proxy):
    add_remote(proxy, "far", upstream.url)  # no path: /v1 is added
    assert "far:latest" in [m["name"] for m in proxy.get("/api/tags")["models"]]
    ai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
    assert "far:latest" in [m.id for m in ai.models.list()]
    listed = proxy.cli("list")
    assert listed.returncode == 0 and "far:latest" in listed.stdout

    # The same greedy request straight to the upstream and through the proxy: same text.
    direct = ollama.Client(host=upstream.url).chat(model="smollm2", messages=HELLO,
                                                   options=GREEDY)
    oc = ollama.Client(host=proxy.url)
    r = oc.chat(model="far", messages=HELLO, options=GREEDY)
    assert r.message.content == direct.message.content and r.message.content.strip()
    assert r.eval_count == direct.eval_count and r.prompt_eval_count == direct.prompt_eval_count
    assert r.eval_duration > 0 and r.prompt_eval_duration > 0 and r.total_duration > 0
    parts = list(oc.chat(model="far", messages=HELLO, options=GREEDY, stream=True))
    assert len(parts) > 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == direct.message.content
    assert parts[-1].eval_count == direct.eval_count

    request = urllib.request.Request(
        proxy.url + "/api/chat", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "far", "messages": HELLO, "options": GREEDY}).encode())
    with urllib.request.urlopen(request, timeout=60) as stream:
        last = [json.loads(line) for line in stream][-1]
    assert last["done"] and last["stats"]["eval_count"] == direct.eval_count  # for the TUI
    assert last["stats"]["context_used"] == direct.eval_count + direct.prompt_eval_count

    g = oc.generate(model="far", prompt="Say hello in five words.", options=GREEDY)
    assert g.response == direct.message.content  # generate applies the chat template too
    raw = oc.generate(model="far", prompt="The capital of France is", raw=True, options=GREEDY)
    raw_direct = ollama.Client(host=upstream.url).generate(
        model="smollm2", prompt="The capital of France is", raw=True, options=GREEDY)
    assert raw.response == raw_direct.response and raw.eval_count == raw_direct.eval_count

    c = ai.chat.completions.create(model="far", messages=HELLO, max_tokens=16, temperature=0)
    assert c.model == "far:latest" and c.choices[0].message.content == direct.message.content
    assert c.usage.completion_tokens == direct.eval_count
    chunks = list(ai.chat.completions.create(model="far", messages=HELLO, max_tokens=16,
                                             temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == direct.message.content
    assert chunks[-1].usage.completion_tokens == direct.eval_count
    assert all(ch.model == "far:latest" for ch in chunks)
    comp = ai.completions.create(model="far", prompt="The capital of France is", max_tokens=16,
                                 temperature=0)
    assert comp.choices[0].text == raw_direct.response

    status, shown = post(proxy, "/api/show", {"model": "far"})
    assert status == 200 and shown["model_info"]["remote.model"] == "smollm2"
    described = proxy.cli("show", "far")
    assert described.returncode == 0 and f"smollm2 at {upstream.url}/v1" in described.stdout

    run = proxy.cli("run", "far", "Say hello.")
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()

    # rm removes the entry only: the upstream keeps its model.
    assert proxy.cli("rm", "far").returncode == 0
    assert proxy.get("/api/tags")["models"] == []
    assert "smollm2:latest" in [m["name"] for m in upstream.get("/api/tags")["models"]]


def test_upstream_failures_are_502_and_504(upstream, proxy):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    add_remote(proxy, "gone", f"http://127.0.0.1:{port}/v1")
    add_remote(proxy, "wrong", upstream.url + "/v1", model="no-such-model")

    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=proxy.url).chat(model="gone", messages=HELLO)
    assert e.value.status_code == 502 and "cannot connect" in str(e.value)
    ai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e2:
        ai.chat.completions.create(model="wrong", messages=HELLO, stream=True)
    assert e2.value.status_code == 502 and "no-such-model" in str(e2.value)  # upstream's words
    status, body = post(proxy, "/api/generate", {"model": "wrong", "prompt": "hi"})
    assert status == 502 and "404" in body["error"]

    # A server that accepts the connection and never answers: 504 after remote_timeout, which
    # the daemon reads from its config file on each request.
    config = Path(proxy.env["XDG_CONFIG_HOME"]) / "localllm" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text("remote_timeout = 3\n")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    add_remote(proxy, "silent", f"http://127.0.0.1:{silent.getsockname()[1]}/v1")
    try:
        status, body = post(proxy, "/v1/chat/completions", {"model": "silent",
                                                            "messages": HELLO})
    finally:
        silent.close()
    assert status == 504 and "no answer within 3 s" in body["error"]["message"]
    assert proxy.get("/api/version")["version"]


def test_upstream_dying_mid_answer_gives_an_error_and_the_daemon_stays_up(upstream, proxy):
    add_remote(proxy, "far", upstream.url)
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    stream = ollama.Client(host=proxy.url).chat(
        model="far", messages=story, stream=True,
        options={"num_predict": 4000, "temperature": 0.8, "seed": 3})
    first = next(stream)
    assert first.message.content and not first.done
    upstream.proc.send_signal(signal.SIGKILL)  # the upstream dies with the answer under way
    upstream.proc.wait()
    with pytest.raises(ollama.ResponseError) as e:
        for part in stream:
            assert not part.done, "the answer cannot finish: its upstream is gone"
    assert "remote model far" in str(e.value)

    ai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as e2:
        ai.chat.completions.create(model="far", messages=HELLO)
    assert e2.value.status_code == 502
    assert proxy.proc.poll() is None and proxy.get("/api/version")["version"]


def test_openai_stream_breaking_off_ends_in_an_error_event(upstream, proxy):
    add_remote(proxy, "far", upstream.url)
    request = urllib.request.Request(
        proxy.url + "/v1/completions", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "far", "prompt": "Once upon a time", "max_tokens": 4000,
                         "stream": True, "temperature": 0.8, "seed": 5}).encode())
    lines: list[str] = []
    with urllib.request.urlopen(request, timeout=60) as r:
        lines.append(r.readline().decode())
        killer = threading.Thread(target=lambda: (upstream.proc.kill(), upstream.proc.wait()))
        killer.start()
        lines += [line.decode() for line in r]
        killer.join()
    events = [json.loads(x[5:]) for x in lines if x.startswith("data: {")]
    assert events[0]["model"] == "far:latest"
    assert "error" in events[-1] and "data: [DONE]\n" not in lines
    wait_for(lambda: proxy.get("/api/version"), 10, what="the proxy answering")


def test_remote_add_refuses_bad_input(proxy):
    for args, words in ((["../x", "--url", "http://h/v1"], "invalid model name"),
                        (["ok", "--url", "ftp://h"], "http:// or https://"),
                        (["ok", "--url", "http://h:99999/v1"], "invalid port"),
                        (["ok", "--url", "http://h/v1", "--api-key-env", "A-B"],
                         "environment variable name")):
        done = proxy.cli("remote", "add", *args)
        assert done.returncode == 1 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert proxy.get("/api/tags")["models"] == []


def test_api_key_comes_from_the_daemons_environment(tmp_path_factory, smollm2_gguf):
    up_env = isolated_env(tmp_path_factory.mktemp("key"), LOCALLLM_API_KEY="s3cret",
                          LOCALLLM_CONTEXT_LENGTH="512")
    import_models(up_env, {"smollm2": smollm2_gguf})
    up = start_daemon(up_env)
    with_key = start_daemon(isolated_env(tmp_path_factory.mktemp("pk"), UPSTREAM_KEY="s3cret"))
    try:
        done = with_key.cli("remote", "add", "locked", "--url", up.url, "--model", "smollm2",
                            "--api-key-env", "UPSTREAM_KEY")
        assert done.returncode == 0, done.stderr
        r = ollama.Client(host=with_key.url).generate(model="locked", prompt="Hi",
                                                      options=GREEDY)
        assert r.response.strip() and r.eval_count > 0
        # The same entry in a daemon whose environment lacks the key: 502 that says so.
        without = start_daemon(isolated_env(tmp_path_factory.mktemp("nk")))
        try:
            assert without.cli("remote", "add", "locked", "--url", up.url, "--model", "smollm2",
                               "--api-key-env", "UPSTREAM_KEY").returncode == 0
            status, body = post(without, "/api/chat", {"model": "locked", "messages": HELLO})
            assert status == 502 and "UPSTREAM_KEY" in body["error"]
        finally:
            without.stop()
        # A wrong key: the upstream's 401 comes back as 502 with its message.
        wrong = start_daemon(isolated_env(tmp_path_factory.mktemp("wk"), UPSTREAM_KEY="nope"))
        try:
            assert wrong.cli("remote", "add", "locked", "--url", up.url, "--model", "smollm2",
                             "--api-key-env", "UPSTREAM_KEY").returncode == 0
            status, body = post(wrong, "/api/chat", {"model": "locked", "messages": HELLO})
            assert status == 502 and "401" in body["error"] and "API key" in body["error"]
        finally:
            wrong.stop()
    finally:
        with_key.stop()
        up.stop()


def test_launch_sends_an_agent_to_a_remote_model_unsized(upstream, proxy):
    """A remote model has no template or tokenizer here to count the agent's first request
    with: launch leaves the sizing to its server and still sets the agent up."""
    import subprocess
    import sys

    add_remote(proxy, "far", upstream.url)
    env = {**proxy.env, "LOCALLLM_HOST": proxy.url.removeprefix("http://")}
    done = subprocess.run([sys.executable, "-m", "localllm.cli", "launch", "opencode", "--model",
                           "far", "--print-env"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "localllm/far:latest" in done.stdout
    assert "cannot run" not in done.stderr


def test_remote_model_answers_on_the_agents_routes(upstream, proxy):
    """/v1/messages and /v1/responses run a remote model through the one response pipeline:
    the same greedy text as the upstream's own answer, whole and streamed."""
    add_remote(proxy, "far", upstream.url)
    direct = ollama.Client(host=upstream.url).chat(model="smollm2", messages=HELLO,
                                                   options=GREEDY)
    claude = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0)
    m = claude.messages.create(model="far", max_tokens=16, messages=HELLO,
                               extra_body={"temperature": 0})
    assert m.model == "far:latest" and [b.type for b in m.content] == ["text"]
    assert m.content[0].text == direct.message.content
    assert m.usage.output_tokens == direct.eval_count
    assert m.usage.input_tokens == direct.prompt_eval_count
    with claude.messages.stream(model="far", max_tokens=16, messages=HELLO,
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == direct.message.content

    ai = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    r = ai.responses.create(model="far", input=HELLO[0]["content"], max_output_tokens=16,
                            temperature=0)
    assert r.output_text == direct.message.content
    assert r.usage.output_tokens == direct.eval_count
    events = list(ai.responses.create(model="far", input=HELLO[0]["content"],
                                      max_output_tokens=16, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == direct.message.content
    assert events[-1].type == "response.completed"

    # What the upstream cannot be asked from here is a 400 that says so, not a silent drop.
    status, body = post(proxy, "/v1/messages/count_tokens", {"model": "far",
                                                             "messages": HELLO})
    assert status == 400 and "tokenizer" in body["error"]["message"]


# ---- a scripted upstream: reasoning and a tool call, as vLLM streams them ------------------------

def _sse(*chunks: dict) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


@pytest.fixture
def scripted():
    """A real aiohttp server answering /v1/chat/completions with a streamed answer that thinks,
    then calls a tool in pieces, and /v1/embeddings with a vector per input (not of unit length,
    listed last input first, never cut to `dimensions`); it keeps the bodies it was sent."""
    bodies: list[dict] = []

    def piece(delta: dict, finish=None) -> dict:
        return {"id": "x", "object": "chat.completion.chunk", "model": "m",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    async def complete(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        call = {"index": 0, "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": '}}
        await out.write(_sse(
            piece({"role": "assistant", "reasoning_content": "The user wants "}),
            piece({"reasoning_content": "the weather."}),
            piece({"tool_calls": [call]}),
            piece({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
            piece({}, "tool_calls"),
            {"id": "x", "choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 12}}))
        return out

    async def embed(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        if "too long" in body["input"]:
            return web.json_response({"error": {"message": "the input is too long"}}, status=400)
        vectors = {"one": [3.0, 4.0, 0.0], "two": [0.0, 3.0, 4.0]}
        data = [{"object": "embedding", "index": i, "embedding": vectors[text]}
                for i, text in enumerate(body["input"])]
        return web.json_response({"object": "list", "data": data[::-1], "model": "m",
                                  "usage": {"prompt_tokens": 7, "total_tokens": 7}})

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/embeddings", embed)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}/v1", bodies
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def test_a_remote_models_thinking_and_tool_calls_reach_every_wire_format(scripted, proxy):
    url, bodies = scripted
    add_remote(proxy, "tooly", url, model="m")
    ask = [{"role": "user", "content": "Weather in Paris?"}]

    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) \
        .chat.completions.create(model="tooly", messages=ask, tools=WEATHER, temperature=0)
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert c.usage.prompt_tokens == 30 and c.usage.completion_tokens == 12
    sent = bodies[-1]
    assert sent["model"] == "m" and sent["stream"] and sent["tools"] == WEATHER
    assert sent["temperature"] == 0

    m = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0) \
        .messages.create(model="tooly", max_tokens=100, messages=ask, tools=[{
            "name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER[0]["function"]["parameters"]}])
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"]
    assert use[0].name == "get_weather" and use[0].input == {"city": "Paris"}

    # A tool call and its result sent back on the Ollama route reach the upstream as OpenAI's:
    # arguments as JSON text, the call's id on the result.
    r = ollama.Client(host=proxy.url).chat(model="tooly", tools=WEATHER, messages=[
        *ask, {"role": "assistant", "content": "",
               "tool_calls": [{"function": {"name": "get_weather",
                                            "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"}])
    assert r.message.tool_calls[0].function.arguments == {"city": "Paris"}
    assert r.message.thinking == "The user wants the weather."
    call = bodies[-1]["messages"][1]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert bodies[-1]["messages"][2]["role"] == "tool"
    assert bodies[-1]["messages"][2]["content"] == "sunny"


def test_a_remote_model_embeds_through_its_upstream(scripted, proxy):
    url, bodies = scripted
    add_remote(proxy, "emb", url, model="m")
    r = ollama.Client(host=proxy.url).embed(model="emb", input=["one", "two"])
    assert bodies[-1] == {"model": "m", "input": ["one", "two"]}
    # In the inputs' order and of unit length, as a local model's are.
    assert r.embeddings == [[0.6, 0.8, 0.0], [0.0, 0.6, 0.8]]
    assert r.prompt_eval_count == 7 and r.load_duration == 0

    assert post(proxy, "/api/embeddings", {"model": "emb", "prompt": "one"}) == (
        200, {"embedding": [0.6, 0.8, 0.0]})
    v1 = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0) \
        .embeddings.create(model="emb", input="two", dimensions=2)
    assert bodies[-1] == {"model": "m", "input": ["two"], "dimensions": 2}
    assert v1.data[0].embedding == [0.0, 1.0]  # the upstream sent 3: cut here, then scaled
    assert v1.usage.prompt_tokens == 7

    status, error = post(proxy, "/api/embed", {"model": "emb", "input": "too long"})
    assert status == 502 and "answered 400: the input is too long" in error["error"]
    assert post(proxy, "/api/embed", {"model": "emb", "input": "one"})[0] == 200  # still up
