"""Remote models: an OpenAI-compatible server (vLLM, SGLang, llama-server, another localllm)
behind every inference route, as if the model were loaded here.

Ollama requests become the upstream's OpenAI requests, always streamed from it (so that the
caller's stream starts with the upstream's first token, and timings can be taken), and come
back in Ollama's shapes with usage and timings in its fields; OpenAI requests pass through with
the model renamed both ways. Upstream failures become ApiErrors before the first byte
(502: refused, unreachable or a bad answer; 504: no answer in time) and an error line or event
after it; nothing here can take the daemon down.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from localllm.modelstore.names import BadModelName
from localllm.modelstore.store import ModelEntry, StoreError

from localllm import options
from localllm.config import Config, ConfigError, load_config

from .api.common import ApiError, get_bool, get_messages, get_str
from .state import STORE

CONNECT_TIMEOUT_S = 10.0
NDJSON = "application/x-ndjson"


class UpstreamError(Exception):
    """The upstream failed after its answer had started."""


def remote_entry(app: web.Application, body: dict) -> ModelEntry | None:
    """The remote model a request names, or None (the route then handles it, errors too)."""
    name = body.get("model") or body.get("name")
    if not isinstance(name, str):
        return None
    try:
        entry = app[STORE].get(name)
    except (StoreError, BadModelName):
        return None
    return entry if entry.remote is not None else None


def show(entry: ModelEntry) -> dict:
    """/api/show for a remote model: where it lives; there is no GGUF to describe."""
    remote = entry.remote
    assert remote is not None
    return {"license": "", "modelfile": f"# remote: {remote.model} at {remote.url}\n",
            "parameters": "", "template": "", "details": entry.details,
            "model_info": {"general.architecture": "remote", "remote.url": remote.url,
                           "remote.model": remote.model},
            "capabilities": ["completion", "chat"], "modified_at": entry.modified_at}


# ---- the upstream ------------------------------------------------------------------------------

@dataclass
class RemoteAnswer:
    """What came back, accumulated: text, why it ended, the upstream's counts and our clock."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # llama-server's, when it sends them

    def stats(self) -> dict:
        """The final chunk's `stats` (localllm's addition): the upstream's counts and our
        clock; the context length is the upstream's secret, so it is left out."""
        m = self.ollama_metrics()
        first = self.first_token_at or time.perf_counter()
        return {key: m[key] for key in ("eval_count", "eval_duration", "prompt_eval_count",
                                        "prompt_eval_duration")} | {
            "context_used": m["prompt_eval_count"] + m["eval_count"],
            "time_to_first_token": int((first - self.started) * 1e9)}

    def ollama_metrics(self) -> dict:
        end = time.perf_counter()
        first = self.first_token_at or end
        prompt_ns = int((first - self.started) * 1e9)
        eval_ns = int((end - first) * 1e9)
        if self.timings.get("prompt_ms") is not None:
            prompt_ns = int(self.timings["prompt_ms"] * 1e6)
        if self.timings.get("predicted_ms") is not None:
            eval_ns = int(self.timings["predicted_ms"] * 1e6)
        return {
            "done_reason": "length" if self.finish_reason == "length" else "stop",
            "total_duration": int((end - self.started) * 1e9),
            "load_duration": 0,
            "prompt_eval_count": int(self.usage.get("prompt_tokens", 0)),
            "prompt_eval_duration": prompt_ns,
            "eval_count": int(self.usage.get("completion_tokens", 0)),
            "eval_duration": eval_ns,
        }


def _headers(entry: ModelEntry) -> dict:
    remote = entry.remote
    assert remote is not None
    headers = {"Content-Type": "application/json"}
    if remote.api_key_env:
        key = os.environ.get(remote.api_key_env)
        if not key:
            raise ApiError(502, f"remote model {entry.name}: the daemon's environment has no "
                                f"{remote.api_key_env} (its API key); set it and restart the "
                                f"daemon")
        headers["Authorization"] = f"Bearer {key}"
    return headers


def _error_text(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace").strip()[:500] or "(empty answer)"
    error = doc.get("error", doc) if isinstance(doc, dict) else doc
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:500]


async def _post(session: aiohttp.ClientSession, entry: ModelEntry, path: str,
                payload: dict) -> aiohttp.ClientResponse:
    """POST to the upstream; any failure before its answer starts is an ApiError."""
    remote = entry.remote
    assert remote is not None
    url = remote.url + path
    where = f"remote model {entry.name} ({remote.url})"
    try:
        response = await session.post(url, json=payload, headers=_headers(entry))
    except (TimeoutError, aiohttp.ServerTimeoutError):
        raise ApiError(504, f"{where}: no answer within {read_timeout():.0f} s") from None
    except aiohttp.ClientConnectorError as e:
        raise ApiError(502, f"{where}: cannot connect: {e.os_error or e}") from None
    except aiohttp.ClientError as e:
        raise ApiError(502, f"{where}: {type(e).__name__}: {e}") from None
    if response.status >= 400:
        text = _error_text(await response.read())
        response.release()
        raise ApiError(502, f"{where} answered {response.status}: {text}")
    return response


async def _chunks(response: aiohttp.ClientResponse, entry: ModelEntry) -> AsyncIterator[dict]:
    """The JSON objects of an SSE stream until [DONE]; UpstreamError when it breaks off."""
    where = f"remote model {entry.name}"
    try:
        async for raw in response.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except ValueError:
                raise UpstreamError(f"{where}: the upstream sent invalid JSON: "
                                    f"{data[:200]}") from None
            if isinstance(chunk, dict) and "error" in chunk:
                raise UpstreamError(f"{where}: the upstream failed: "
                                    f"{_error_text(json.dumps(chunk).encode())}")
            yield chunk
    except (TimeoutError, aiohttp.ClientError) as e:
        raise UpstreamError(f"{where}: the upstream broke off its answer "
                            f"({type(e).__name__}{': ' + str(e) if str(e) else ''})") from None
    raise UpstreamError(f"{where}: the upstream closed the stream before finishing")


def read_timeout() -> float:
    """Seconds the upstream may take to start answering, and between two parts of it."""
    try:
        return float(load_config().remote_timeout)
    except ConfigError:
        return float(Config.remote_timeout)


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
        total=None, connect=CONNECT_TIMEOUT_S, sock_read=read_timeout()))


async def _stream(entry: ModelEntry, path: str, payload: dict,
                  answer: RemoteAnswer) -> AsyncIterator[str]:
    """Text pieces of the upstream's streamed answer, filling `answer` as they come. The
    first step raises ApiError when the upstream cannot be used; later ones UpstreamError."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    async with _session() as session:
        response = await _post(session, entry, path, payload)
        async with response:
            async for chunk in _chunks(response, entry):
                if chunk.get("usage"):
                    answer.usage = chunk["usage"]
                if isinstance(chunk.get("timings"), dict):
                    answer.timings = chunk["timings"]
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                    if choice.get("finish_reason"):
                        answer.finish_reason = choice["finish_reason"]
                    if piece:
                        answer.first_token_at = answer.first_token_at or time.perf_counter()
                        answer.text.append(piece)
                        yield piece


# ---- Ollama routes -----------------------------------------------------------------------------

# The table's samplers an upstream OpenAI-compatible server takes under the same name; load
# options (num_ctx, num_gpu...) are the upstream's own business.
UPSTREAM_SAMPLERS = ("temperature", "top_p", "seed", "stop", "presence_penalty",
                     "frequency_penalty", "top_k", "min_p", "repeat_penalty")


def _openai_options(body: dict) -> dict:
    """Ollama's `options` (and `format`) as OpenAI request fields. Samplers that OpenAI lacks
    (top_k, min_p, repeat_penalty) are passed under their names, which vLLM and llama-server
    read and others ignore."""
    values = body.get("options") or {}
    if not isinstance(values, dict):
        raise ApiError(400, "field 'options' must be an object", "options")
    try:
        given = options.checked(values)  # the same bounds as a local model's
    except options.OptionError as e:
        raise ApiError(400, str(e), e.name) from None
    out = {name: list(value) if name == "stop" else value
           for name, value in given.items() if name in UPSTREAM_SAMPLERS}
    if given.get("num_predict", -1) >= 0:
        out["max_tokens"] = given["num_predict"]
    fmt = body.get("format")
    if fmt == "json":
        out["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": "format", "schema": fmt}}
    return out


def _now_iso() -> str:
    import datetime as dt

    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


async def ollama(request: web.Request, body: dict, entry: ModelEntry) -> web.StreamResponse:
    """/api/generate and /api/chat for a remote model."""
    remote = entry.remote
    assert remote is not None
    chat = request.path == "/api/chat"
    model = str(entry.name)
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
    pieces = _stream(entry, path, payload, answer)
    try:
        first = await anext(pieces, None)  # ApiError from here on still sets the status
        if not stream:
            async for _ in pieces:
                pass
            return web.json_response({"model": model, "created_at": _now_iso(),
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
            await send({"model": model, "created_at": _now_iso(), **shape(piece), "done": False})
            piece = await anext(pieces, None)
        await send({"model": model, "created_at": _now_iso(), **shape(""), "done": True,
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
    return web.json_response({"model": model, "created_at": _now_iso(), **empty, "done": True,
                              "done_reason": reason})


# ---- OpenAI routes -----------------------------------------------------------------------------

async def openai(request: web.Request, body: dict, entry: ModelEntry) -> web.StreamResponse:
    """/v1/chat/completions and /v1/completions for a remote model: the body goes through with
    the upstream's model name, the answer comes back with ours."""
    remote = entry.remote
    assert remote is not None
    path = "/chat/completions" if request.path.endswith("/chat/completions") else "/completions"
    model = str(entry.name)
    payload = {**body, "model": remote.model}
    async with _session() as session:
        if not get_bool(body, "stream", False):
            response = await _post(session, entry, path, payload)
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
        response = await _post(session, entry, path, payload)
        async with response:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                              "Cache-Control": "no-cache"})
            await out.prepare(request)
            try:
                async for chunk in _chunks(response, entry):
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
