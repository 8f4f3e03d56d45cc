"""A remote model's upstream: the client (the POST, its SSE chunks) and the reading of what it
answers, every body with a cap (an error's, an embeddings answer, a streamed line, the tool calls
put together) and every chunk checked for its shape, so that an upstream can neither exhaust the
daemon's memory nor turn into a 500. Credentials in an upstream's URL
(`https://user:secret@host/v1`) are shown as `***` in every message.

Failures before the answer starts are ApiErrors (502: refused, unreachable or a bad answer; 504:
no answer in time), after it UpstreamErrors; daemon/remote.py's engine makes Failure events of
both.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp.http_exceptions import HttpProcessingError
from localllm.engine.runner.protocol import Done, Token
from localllm.modelstore.entries import shown_url
from localllm.modelstore.store import ModelEntry

from localllm.config import Config, ConfigError, load_config

from .http_errors import ApiError

CONNECT_TIMEOUT_S = 10.0
ERROR_BODY_AT_MOST = 64 << 10  # of an error answer, only the start is shown anyway
EMBEDDINGS_AT_MOST = 1 << 20  # an embeddings answer: this, plus per input
EMBEDDING_AT_MOST = 512 << 10  # (8,192 dimensions as JSON text take about 200 KB)
TOOL_CALLS_AT_MOST = 4 << 20  # the streamed tool calls of one answer, put together


class UpstreamError(Exception):
    """The upstream failed after its answer had started."""


# ---- the upstream ------------------------------------------------------------------------------

@dataclass
class RemoteAnswer:
    """What came back so far: pieces of text, why it ended, the upstream's counts, our clock."""

    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    pieces: int = 0  # streamed pieces of text: about one token each
    finish_reason: str | None = None
    usage: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)  # llama-server's, when it sends them

    def durations_ns(self) -> tuple[int, int]:
        """(prompt, answer) durations: the upstream's timings when it sends them, else our
        clock (the prompt up to the first piece, the answer after it)."""
        end = time.perf_counter()
        first = self.first_token_at or end
        prompt_ns, eval_ns = int((first - self.started) * 1e9), int((end - first) * 1e9)
        if self.timings.get("prompt_ms") is not None:
            prompt_ns = int(self.timings["prompt_ms"] * 1e6)
        if self.timings.get("predicted_ms") is not None:
            eval_ns = int(self.timings["predicted_ms"] * 1e6)
        return prompt_ns, eval_ns

    def token(self, text: str) -> Token:
        """A piece of text with the answer's running totals; the prompt's count comes with the
        upstream's usage, at the end."""
        self.first_token_at = self.first_token_at or time.perf_counter()
        self.pieces += 1
        _, eval_ns = self.durations_ns()
        return Token(text, eval_count=self.pieces, eval_duration_ns=eval_ns,
                     context_used=self.pieces)

    def done(self) -> Done:
        """The answer's Done; the context length is the upstream's secret, so it is 0."""
        prompt_tokens = int(self.usage.get("prompt_tokens", 0))
        answer_tokens = int(self.usage.get("completion_tokens", self.pieces))
        prompt_ns, eval_ns = self.durations_ns()
        return Done("length" if self.finish_reason == "length" else "stop",
                    prompt_eval_count=prompt_tokens, prompt_eval_duration_ns=prompt_ns,
                    eval_count=answer_tokens, eval_duration_ns=eval_ns,
                    prompt_tokens=prompt_tokens, cached_tokens=0,
                    context_used=prompt_tokens + answer_tokens, n_ctx=0)


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


def scrubbed(text: str, url: str) -> str:
    """`text` (an error of aiohttp's, an upstream's words) without the credentials of `url`."""
    host = url.partition("://")[2].partition("/")[0]
    userinfo = host.rpartition("@")[0]
    if userinfo:
        for secret in (userinfo, *userinfo.split(":")):
            if len(secret) >= 3:  # "a" or "x" would blot out unrelated text
                text = text.replace(secret, "***")
    return text


async def read_capped(response: aiohttp.ClientResponse, at_most: int, what: str) -> bytes:
    """The answer's body, read to at most `at_most` bytes: ApiError 502 past that (the rest is
    never read)."""
    body = await response.content.read(at_most + 1)
    while len(body) <= at_most and (more := await response.content.read(at_most + 1 - len(body))):
        body += more
    if len(body) > at_most:
        raise ApiError(502, f"{what}: the upstream's answer is larger than "
                            f"{at_most >> 10} KiB")
    return body


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
    where = f"remote model {entry.name} ({shown_url(remote.url)})"
    try:
        response = await session.post(url, json=payload, headers=_headers(entry))
    except (TimeoutError, aiohttp.ServerTimeoutError):
        raise ApiError(504, f"{where}: no answer within {read_timeout():.0f} s") from None
    except aiohttp.ClientConnectorError as e:
        raise ApiError(502, scrubbed(f"{where}: cannot connect: {e.os_error or e}",
                                     remote.url)) from None
    except (aiohttp.ClientError, ValueError) as e:  # ValueError: a URL aiohttp refuses
        raise ApiError(502, scrubbed(f"{where}: {type(e).__name__}: {e}", remote.url)) from None
    if response.status >= 400:
        try:  # only the start of an error is shown: the rest is never read
            raw = await response.content.read(ERROR_BODY_AT_MOST)
        except (TimeoutError, aiohttp.ClientError):
            raw = b""
        response.close()
        raise ApiError(502, scrubbed(f"{where} answered {response.status}: "
                                     f"{_error_text(raw)}", remote.url))
    return response


async def chunks(response: aiohttp.ClientResponse, entry: ModelEntry) -> AsyncIterator[dict]:
    """The JSON objects of an SSE stream until [DONE]; UpstreamError when it breaks off."""
    where = f"remote model {entry.name}"
    try:
        # aiohttp reads a line up to its buffer's limit (a longer one is LineTooLong)
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
            except RecursionError:
                raise UpstreamError(f"{where}: the upstream sent JSON nested too deeply") \
                    from None
            if not isinstance(chunk, dict):
                raise UpstreamError(f"{where}: the upstream sent a JSON "
                                    f"{type(chunk).__name__}, not a chunk object")
            if "error" in chunk:
                raise UpstreamError(scrubbed(f"{where}: the upstream failed: "
                                             f"{_error_text(json.dumps(chunk).encode())}",
                                             entry.remote.url))
            yield chunk
    except (ValueError, HttpProcessingError) as e:  # LineTooLong, or older aiohttp's ValueError
        raise UpstreamError(f"{where}: the upstream sent a line too long to read "
                            f"({type(e).__name__})") from None
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


class _Calls:
    """The upstream's streamed tool calls, put together by index (names and arguments come in
    pieces), written at the end as Hermes calls for the parser."""

    def __init__(self) -> None:
        self.calls: dict[int, dict] = {}
        self.size = 0

    def add(self, deltas: list) -> None:
        """The pieces of one chunk; TypeError/ValueError for pieces of the wrong shape."""
        for delta in deltas:
            call = self.calls.setdefault(int(delta.get("index", len(self.calls))),
                                         {"name": "", "arguments": ""})
            function = delta.get("function") or {}
            name = function.get("name") or ""
            arguments = function.get("arguments") or ""
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments)
            if not isinstance(name, str):
                raise TypeError("a tool call's name is not text")
            call["name"] += name
            call["arguments"] += arguments
            self.size += len(name) + len(arguments)
            if self.size > TOOL_CALLS_AT_MOST or len(self.calls) > 1024:
                raise ValueError(f"its tool calls run past {TOOL_CALLS_AT_MOST >> 20} MiB")

    def text(self) -> str:
        out = ""
        for _, call in sorted(self.calls.items()):
            try:
                arguments = json.loads(call["arguments"] or "{}")
            except ValueError:
                arguments = call["arguments"]
            out += (f"<tool_call>\n{json.dumps({'name': call['name'], 'arguments': arguments})}"
                    f"\n</tool_call>")
        return out


def _read_chunk(chunk: dict, answer: RemoteAnswer, calls: _Calls, thinking: bool
                ) -> tuple[list[str], bool]:
    """One chunk of an OpenAI stream: its pieces of text (thinking in think tags) and whether
    the answer is thinking after it; the usage, timings, finish reason and tool calls kept.
    TypeError/ValueError/AttributeError for a chunk of the wrong shape (a 502 saying so)."""
    usage, timings = chunk.get("usage"), chunk.get("timings")
    if usage:
        if not all(isinstance(usage.get(k, 0), int) for k in ("prompt_tokens",
                                                               "completion_tokens")):
            raise TypeError("its usage counts are not whole numbers")
        answer.usage = usage
    if isinstance(timings, dict):
        if not all(isinstance(timings.get(k, 0), (int, float)) for k in ("prompt_ms",
                                                                          "predicted_ms")):
            raise TypeError("its timings are not numbers")
        answer.timings = timings
    texts = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text = ""
        if reasoning := delta.get("reasoning_content") or delta.get("reasoning"):
            text, thinking = ("" if thinking else "<think>") + _text(reasoning), True
        if content := delta.get("content") or choice.get("text") or "":
            text += ("</think>" if thinking else "") + _text(content)
            thinking = False
        calls.add(delta.get("tool_calls") or [])
        finish = choice.get("finish_reason")
        answer.finish_reason = _text(finish) if finish else answer.finish_reason
        if text:
            texts.append(text)
    return texts, thinking


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a JSON {type(value).__name__} where text belongs")
    return value
