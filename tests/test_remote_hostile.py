"""A remote upstream can neither exhaust the daemon's memory nor turn into a 500, and the
credentials in its URL are never shown (issue 68, item 4): a real daemon in front of a real
aiohttp server scripted as a hostile upstream, answering by the model it is asked for."""

from __future__ import annotations

import asyncio
import json
import socket
import stat
import threading
from pathlib import Path

import pytest
from aiohttp import web
from daemon_process import isolated_env, start_daemon
from test_remote import add_remote, post

SECRET = "s3cret-pass-word"
BIG = 128 << 20  # the body an upstream sends where a short one belongs


def _sse(*chunks: str) -> bytes:
    return b"".join(f"data: {c}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _chunk(delta: dict) -> str:
    return json.dumps({"id": "x", "choices": [{"index": 0, "delta": delta}]})


GOOD = _chunk({"content": "hi"})
# Chunks of the wrong shape, each after a first good piece or alone: all a 502 that says so.
MALFORMED = {
    "a list": "[1, 2]",
    "a number": "5",
    "choices as text": json.dumps({"choices": "abc"}),
    "delta as a list": json.dumps({"choices": [{"delta": [1]}]}),
    "content as a number": _chunk({"content": 5}),
    "reasoning as an object": _chunk({"reasoning_content": {"a": 1}}),
    "usage as text": json.dumps({"choices": [], "usage": "lots"}),
    "usage counts as text": json.dumps({"choices": [], "usage": {"prompt_tokens": "many"}}),
    "timings as text": json.dumps({"choices": [], "timings": {"prompt_ms": "slow"}}),
    "tool calls as an object": _chunk({"tool_calls": {"index": 0}}),
    "tool call index as text": _chunk({"tool_calls": [{"index": "first"}]}),
    "tool call name as a number": _chunk({"tool_calls": [{"function": {"name": 7}}]}),
    "finish reason as a list": json.dumps({"choices": [{"delta": {}, "finish_reason": [1]}]}),
    "nested too deeply": "[" * 100_000 + "]" * 100_000,
}


async def _write_big(request: web.Request, status: int, content_type: str) -> web.StreamResponse:
    out = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    await out.prepare(request)
    piece = b"x" * (1 << 20)
    try:
        for _ in range(BIG // len(piece)):
            await out.write(piece)
    except (ConnectionError, RuntimeError):
        pass  # the daemon read what it needed and went
    return out


@pytest.fixture
def hostile():
    async def complete(request: web.Request) -> web.StreamResponse:
        model = (await request.json())["model"]
        if model == "big-error":
            return await _write_big(request, 500, "text/plain")
        if model == "echo-secret":
            return web.json_response({"error": {"message": f"bad key for {request.url} "
                                                           f"({SECRET})"}}, status=401)
        if model == "long-line":
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            await out.write(b"data: " + b"x" * (8 << 20))
            return out
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        await out.write(_sse(MALFORMED[model]))
        return out

    async def embed(request: web.Request) -> web.StreamResponse:
        model = (await request.json())["model"]
        if model == "big-embeddings":
            return await _write_big(request, 200, "application/json")
        if model == "usage-as-text":
            return web.json_response({"data": [{"index": 0, "embedding": [1.0, 0.0]}],
                                      "usage": {"prompt_tokens": "many"}})
        return web.Response(text="[" * 100_000 + "]" * 100_000,
                            content_type="application/json")

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
    yield f"http://127.0.0.1:{port}/v1"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def front(tmp_path_factory):
    """A daemon with only remote entries, in front of the hostile upstream."""
    d = start_daemon(isolated_env(tmp_path_factory.mktemp("front")))
    yield d
    d.stop()


def _peak_rss(daemon) -> int:
    """The daemon's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_streamed_answer_is_a_502_saying_what_was_wrong(hostile, front, case):
    add_remote(front, "odd", hostile, model=case)
    status, body = post(front, "/api/chat", {"model": "odd", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 502, body
    assert "upstream" in body["error"]
    status, body = post(front, "/v1/chat/completions", {"model": "odd", "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 502, body
    assert front.get("/api/version")["version"]


def test_a_huge_error_body_or_answer_is_read_only_to_a_cap(hostile, front):
    before = _peak_rss(front)
    add_remote(front, "loud", hostile, model="big-error")
    status, body = post(front, "/api/chat", {"model": "loud", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 502 and "answered 500" in body["error"]
    assert len(body["error"]) < 2000
    add_remote(front, "fat", hostile, model="big-embeddings")
    status, body = post(front, "/api/embed", {"model": "fat", "input": "one"})
    assert status == 502 and "larger than" in body["error"]
    add_remote(front, "long", hostile, model="long-line")
    status, body = post(front, "/api/chat", {"model": "long", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 502 and "too long" in body["error"]
    assert _peak_rss(front) - before < 48 << 20  # read whole, each cost BIG and more


@pytest.mark.parametrize("model", ["usage-as-text", "nested"])
def test_a_malformed_embeddings_answer_is_a_502(hostile, front, model):
    add_remote(front, "emb", hostile, model=model)
    status, body = post(front, "/api/embed", {"model": "emb", "input": "one"})
    assert status == 502 and "not OpenAI's list of embeddings" in body["error"]


def test_credentials_in_a_remote_url_are_never_shown(hostile, front):
    url = hostile.replace("http://", f"http://me:{SECRET}@")
    added = front.cli("remote", "add", "keyed", "--url", url, "--model", "echo-secret")
    assert added.returncode == 0 and SECRET not in added.stdout and "***@" in added.stdout
    listed = front.cli("remote", "list")
    assert listed.returncode == 0 and SECRET not in listed.stdout and "***@" in listed.stdout
    status, shown = post(front, "/api/show", {"model": "keyed"})
    assert status == 200 and SECRET not in json.dumps(shown)
    assert shown["model_info"]["remote.url"].startswith("http://***@127.0.0.1:")
    assert SECRET not in front.cli("show", "keyed").stdout
    status, body = post(front, "/api/chat", {"model": "keyed", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 502 and "answered 401" in body["error"] and SECRET not in body["error"]
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert front.cli("remote", "add", "gone", "--url",
                     f"http://me:{SECRET}@127.0.0.1:{port}/v1").returncode == 0
    status, body = post(front, "/api/chat", {"model": "gone", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]})
    assert status == 502 and SECRET not in body["error"]
    manifest = Path(front.env["XDG_DATA_HOME"]) / "localllm/models/manifests/keyed/latest"
    assert stat.S_IMODE(manifest.stat().st_mode) == 0o600  # where the secret is kept
    log = Path(front.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
    assert SECRET not in log.read_text()
