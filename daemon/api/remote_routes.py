"""Remote models' answers, on the routes of ROUTES: the remote middleware (server.py) sends a
remote model's request here whichever route it came by, as Ollama chains its OpenAI and
Anthropic middleware in front of one chat handler; the upstream's client is daemon/remote.py.

Ollama requests become the upstream's OpenAI requests, always streamed from it (so that the
caller's stream starts with the upstream's first token, and timings can be taken), and come
back in Ollama's shapes with usage and timings in its fields; OpenAI requests pass through with
the model renamed both ways. An upstream that fails after the first byte is an error line or
event.
"""

from __future__ import annotations

import json

import aiohttp
from aiohttp import web
from localllm.modelstore.store import ModelEntry

from ..http_errors import ApiError
from ..remote import (
    RemoteAnswer,
    UpstreamError,
    _openai_options,
    chunks,
    post,
    read_timeout,
    stream_text,
    upstream_session,
)
from .common import get_bool, get_messages, get_str
from .ollama import NDJSON, now_iso
from .respond import SSE


def show(entry: ModelEntry) -> dict:
    """/api/show for a remote model: where it lives; there is no GGUF to describe."""
    remote = entry.remote
    assert remote is not None
    return {"license": "", "modelfile": f"# remote: {remote.model} at {remote.url}\n",
            "parameters": "", "template": "", "details": entry.details,
            "model_info": {"general.architecture": "remote", "remote.url": remote.url,
                           "remote.model": remote.model},
            "capabilities": ["completion", "chat"], "modified_at": entry.modified_at}


# ---- Ollama routes -----------------------------------------------------------------------------

async def ollama(request: web.Request, body: dict, entry: ModelEntry) -> web.StreamResponse:
    """/api/generate and /api/chat for a remote model."""
    remote = entry.remote
    assert remote is not None
    chat = request.path == "/api/chat"
    model = entry.name.tagged
    stream = get_bool(body, "stream", True)
    if chat:
        shape = lambda text: {"message": {"role": "assistant", "content": text}}
        if body.get("messages") in (None, []):
            return _loaded(model, shape(""), body)
        path, payload = "/chat/completions", {"messages": list(get_messages(body))}
        if isinstance(body.get("tools"), list):
            payload["tools"] = body["tools"]
    else:
        shape = lambda text: {"response": text}
        prompt = get_str(body, "prompt", default="")
        if not prompt:
            return _loaded(model, shape(""), body)
        system = get_str(body, "system")
        if body.get("raw"):
            path = "/completions"
            payload = {"prompt": f"{system}\n\n{prompt}" if system else prompt}
        else:
            path = "/chat/completions"
            messages = [{"role": "system", "content": system}] if system else []
            payload = {"messages": messages + [{"role": "user", "content": prompt}]}
    payload = {"model": remote.model, **payload, **_openai_options(body)}
    answer = RemoteAnswer()
    pieces = stream_text(entry, path, payload, answer)
    try:
        first = await anext(pieces, None)  # ApiError from here on still sets the status
        if not stream:
            async for _ in pieces:
                pass
            return web.json_response({"model": model, "created_at": now_iso(),
                                      **shape("".join(answer.text)), "done": True,
                                      **answer.ollama_metrics()})
    except UpstreamError as e:
        raise ApiError(502, str(e)) from None
    response = web.StreamResponse(headers={"Content-Type": NDJSON})
    await response.prepare(request)

    async def send(line: dict) -> None:
        await response.write(json.dumps(line).encode() + b"\n")

    try:
        piece = first
        while piece is not None:
            await send({"model": model, "created_at": now_iso(), **shape(piece), "done": False})
            piece = await anext(pieces, None)
        await send({"model": model, "created_at": now_iso(), **shape(""), "done": True,
                    **answer.ollama_metrics(), "stats": answer.stats()})
    except UpstreamError as e:
        await send({"error": str(e)})
    except ConnectionError:
        return response  # the client went away; leaving closes the upstream request
    finally:
        await pieces.aclose()
    await response.write_eof()
    return response


def _loaded(model: str, empty: dict, body: dict) -> web.Response:
    """An empty prompt asks Ollama to load (or with keep_alive 0 unload) the model: a remote
    one is always ready, so the answer is immediate."""
    reason = "unload" if body.get("keep_alive") in (0, "0", "0s") else "load"
    return web.json_response({"model": model, "created_at": now_iso(), **empty, "done": True,
                              "done_reason": reason})


# ---- OpenAI routes -----------------------------------------------------------------------------

async def openai(request: web.Request, body: dict, entry: ModelEntry) -> web.StreamResponse:
    """/v1/chat/completions and /v1/completions for a remote model: the body goes through with
    the upstream's model name, the answer comes back with ours."""
    remote = entry.remote
    assert remote is not None
    path = "/chat/completions" if request.path.endswith("/chat/completions") else "/completions"
    model = entry.name.tagged
    payload = {**body, "model": remote.model}
    async with upstream_session() as session:
        if not get_bool(body, "stream", False):
            response = await post(session, entry, path, payload)
            async with response:
                try:
                    doc = await response.json(content_type=None)
                except TimeoutError:
                    raise ApiError(504, f"remote model {entry.name}: no answer within "
                                        f"{read_timeout():.0f} s") from None
                except (aiohttp.ClientError, ValueError) as e:
                    raise ApiError(502, f"remote model {entry.name}: no valid answer "
                                        f"({type(e).__name__})") from None
            if not isinstance(doc, dict):
                raise ApiError(502, f"remote model {entry.name}: the answer is not an object")
            return web.json_response({**doc, "model": model})
        response = await post(session, entry, path, payload)
        async with response:
            out = web.StreamResponse(headers=SSE)
            await out.prepare(request)
            try:
                async for chunk in chunks(response, entry):
                    await out.write(f"data: {json.dumps({**chunk, 'model': model})}\n\n".encode())
                await out.write(b"data: [DONE]\n\n")
            except UpstreamError as e:
                error = {"error": {"message": str(e), "type": "upstream_error", "param": None,
                                   "code": None}}
                await out.write(f"data: {json.dumps(error)}\n\n".encode())
            except ConnectionError:
                return out
            await out.write_eof()
            return out


async def ollama_show(request: web.Request, body: dict, entry: ModelEntry) -> web.Response:
    return web.json_response(show(entry))


# The routes that answer for a remote model here, and how.
ROUTES = {"/api/generate": ollama, "/api/chat": ollama, "/api/show": ollama_show,
          "/v1/chat/completions": openai, "/v1/completions": openai}
