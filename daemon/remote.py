"""Remote models' upstream: an OpenAI-compatible server (vLLM, SGLang, llama-server, another
localllm) that answers for a stored remote model. This is its client: the POST, its SSE chunks,
the streamed text with usage and timings, and Ollama's options as OpenAI request fields. The
routes that put it behind every inference route are api/remote_routes.py.

Upstream failures become ApiErrors before the first byte (502: refused, unreachable or a bad
answer; 504: no answer in time) and UpstreamError after it; nothing here can take the daemon
down.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from localllm.modelstore.store import ModelEntry

from localllm import options
from localllm.config import Config, ConfigError, load_config

from .http_errors import ApiError

CONNECT_TIMEOUT_S = 10.0


class UpstreamError(Exception):
    """The upstream failed after its answer had started."""


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


async def post(session: aiohttp.ClientSession, entry: ModelEntry, path: str,
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


async def chunks(response: aiohttp.ClientResponse, entry: ModelEntry) -> AsyncIterator[dict]:
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


def upstream_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
        total=None, connect=CONNECT_TIMEOUT_S, sock_read=read_timeout()))


async def stream_text(entry: ModelEntry, path: str, payload: dict,
                  answer: RemoteAnswer) -> AsyncIterator[str]:
    """Text pieces of the upstream's streamed answer, filling `answer` as they come. The
    first step raises ApiError when the upstream cannot be used; later ones UpstreamError."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    async with upstream_session() as session:
        response = await post(session, entry, path, payload)
        async with response:
            async for chunk in chunks(response, entry):
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


# ---- Ollama's options, for the upstream -------------------------------------------------------

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
