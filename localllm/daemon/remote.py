"""Remote models: an OpenAI-compatible server (vLLM, SGLang, llama-server, another localllm)
that answers for a stored remote model, as an Engine (engine/seam.py) beside the local runner.
Here are its client (the POST, its SSE chunks), the chat layer's request as the upstream's
OpenAI request (`prepared`), and `RemoteEngine`, which streams the upstream's answer back as the
runner's typed events; the response pipeline (api/respond.py) and every route's writer take it
from there.

Upstream failures become ApiErrors inside the client (502: refused, unreachable or a bad
answer; 504: no answer in time) and UpstreamError after the answer started; the engine turns
both into Failure events, so nothing here can take the daemon down.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import aiohttp
from localllm.engine.runner.protocol import Done, Embeddings, EmbedRequest, Event, Failure, Token
from localllm.modelstore.store import ModelEntry

from localllm.config import Config, ConfigError, load_config
from localllm.options import SamplingOptions

from .chat.errors import ChatError
from .chat.parse import call_id, make_parser
from .chat.request import ChatRequest, Prepared
from .chat.template import HERMES, THINK_TAGS
from .http_errors import ApiError

CONNECT_TIMEOUT_S = 10.0


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




# ---- the request the upstream takes ----------------------------------------------------------

@dataclass(frozen=True)
class UpstreamRequest:
    """One answer asked of the upstream: the OpenAI route and its body (without the model)."""
    id: str
    path: str  # "/chat/completions" or "/completions"
    payload: dict


# The table's samplers an upstream OpenAI-compatible server takes under the same name (vLLM and
# llama-server read top_k, min_p and repeat_penalty; others ignore them); load options (num_ctx,
# num_gpu...) are the upstream's own business.
UPSTREAM_SAMPLERS = ("temperature", "top_p", "seed", "stop", "presence_penalty",
                     "frequency_penalty", "top_k", "min_p", "repeat_penalty")
_DEFAULTS = SamplingOptions()


def _samplers(given: SamplingOptions) -> dict:
    """The request's samplers that differ from the option table's defaults (the upstream keeps
    its own defaults for the rest), and num_predict as max_tokens."""
    out = {name: list(value) if name == "stop" else value for name in UPSTREAM_SAMPLERS
           if (value := getattr(given, name)) != getattr(_DEFAULTS, name)}
    if given.num_predict >= 0:
        out["max_tokens"] = given.num_predict
    return out


def _message(message: dict) -> dict:
    """A chat layer (Hugging Face) message as OpenAI's: tool calls' arguments as JSON text."""
    out = {key: message[key] for key in ("role", "content", "name", "tool_call_id")
           if message.get(key) is not None}
    if message.get("tool_calls"):
        out["tool_calls"] = [{
            "id": call.get("id") or call_id(), "type": "function",
            "function": {"name": call["function"]["name"],
                         "arguments": args if isinstance(args := call["function"].get(
                             "arguments", {}), str) else json.dumps(args)}}
            for call in message["tool_calls"]]
    return out


def _refuse_unsent(chat: ChatRequest) -> None:
    """What the upstream's OpenAI request does not carry from here: a 400 that says so."""
    for asked, what, param in ((chat.images or chat.has_images, "images", "images"),
                               (chat.suffix, "insert (suffix)", "suffix"),
                               (chat.logprobs is not None or chat.echo, "logprobs", "logprobs")):
        if asked:
            raise ChatError(f"{chat.model_name} is a remote model: its requests carry no "
                            f"{what} to the upstream", param)


def prepared(chat: ChatRequest) -> Prepared:
    """The chat layer's request as its upstream's: a chat (messages, or a prompt with its system
    prompt, which the upstream's template renders) or a raw completion; with the parser that
    reads the upstream's answer as the engine streams it (thinking in think tags, tool calls as
    Hermes's), so that every route's writer reads it as a local model's."""
    _refuse_unsent(chat)
    if chat.messages is not None:
        path, payload = "/chat/completions", {"messages": [_message(m) for m in chat.messages]}
    elif chat.raw:
        prompt = chat.prompt or ""
        path, payload = "/completions", {
            "prompt": f"{chat.system}\n\n{prompt}" if chat.system else prompt}
    else:
        system = [{"role": "system", "content": chat.system}] if chat.system else []
        path, payload = "/chat/completions", {
            "messages": [*system, {"role": "user", "content": chat.prompt or ""}]}
    payload.update(_samplers(chat.options))
    if chat.tools and path == "/chat/completions":
        payload["tools"] = list(chat.tools)
        choice = chat.tool_choice
        if choice != "auto":
            payload["tool_choice"] = choice if isinstance(choice, str) else {
                "type": "function", "function": {"name": choice.get("name")}}
    if chat.format == "json":
        payload["response_format"] = {"type": "json_object"}
    elif isinstance(chat.format, dict):
        payload["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "format", "schema": chat.format}}
    parser = make_parser(HERMES, THINK_TAGS, tools=bool(chat.tools),
                         keep_thinking=chat.think is not False)
    return Prepared(UpstreamRequest(chat.id, path, payload), parser, "")


# ---- the engine ---------------------------------------------------------------------------------

class _Calls:
    """The upstream's streamed tool calls, put together by index (names and arguments come in
    pieces), written at the end as Hermes calls for the parser."""

    def __init__(self) -> None:
        self.calls: dict[int, dict] = {}

    def add(self, deltas: list) -> None:
        for delta in deltas:
            call = self.calls.setdefault(int(delta.get("index", len(self.calls))),
                                         {"name": "", "arguments": ""})
            function = delta.get("function") or {}
            call["name"] += function.get("name") or ""
            arguments = function.get("arguments") or ""
            call["arguments"] += arguments if isinstance(arguments, str) else json.dumps(
                arguments)

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


class RemoteEngine:
    """A remote model as an Engine (engine/seam.py): always ready (its upstream loads and
    schedules for itself), one streamed upstream request per answer. Failures are Failure
    events: before the first piece with the status an HTTP error takes (502: refused,
    unreachable or a bad answer; 504: no answer in time), after it as the stream's end."""

    load_duration_ns = 0
    loaded_at = 0.0
    n_ctx = 0  # the upstream's secret
    alive = True

    def __init__(self, entry: ModelEntry):
        assert entry.remote is not None
        self.entry = entry
        self.model_name = entry.name.tagged
        self.tokens_generated = 0

    async def start(self, timeout: float | None = None) -> None:
        """Nothing to load here."""

    async def stop(self) -> None:
        """Nothing to unload here: leaving an answer's stream closes its upstream request."""

    def figures(self) -> dict:
        return {"loaded_at": self.loaded_at, "load_duration": self.load_duration_ns,
                "context_length": self.n_ctx, "tokens_generated": self.tokens_generated}

    async def count_tokens(self, text: str) -> int:
        raise self._no_tokenizer()

    async def count_tokens_each(self, texts: list[str]) -> list[int]:
        raise self._no_tokenizer()

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """The upstream's /embeddings of the inputs, as the runner's: unit vectors, each cut to
        `dimensions` when the upstream sent more. Inputs longer than its context are the
        upstream's to refuse or cut (OpenAI's API has no `truncate`)."""
        payload: dict = {"model": self.entry.remote.model, "input": list(request.inputs)}
        if request.dimensions:
            payload["dimensions"] = request.dimensions
        started = time.perf_counter_ns()
        async with upstream_session() as session:
            response = await post(session, self.entry, "/embeddings", payload)
            async with response:
                try:
                    doc = json.loads(await response.read())
                    rows = sorted(doc["data"], key=lambda row: int(row.get("index", 0)))
                    vectors = tuple(_unit(row["embedding"][:request.dimensions or None])
                                    for row in rows)
                except (TimeoutError, aiohttp.ClientError) as e:
                    raise ApiError(502, f"remote model {self.model_name}: the upstream broke "
                                        f"off its answer ({type(e).__name__})") from None
                except (ValueError, KeyError, TypeError, AttributeError):
                    raise ApiError(502, f"remote model {self.model_name}: the upstream's "
                                        f"/embeddings answer is not OpenAI's list of "
                                        f"embeddings") from None
        if len(vectors) != len(request.inputs):
            raise ApiError(502, f"remote model {self.model_name}: the upstream sent "
                                f"{len(vectors)} embeddings for {len(request.inputs)} inputs")
        usage = doc.get("usage") if isinstance(doc.get("usage"), dict) else {}
        return Embeddings(vectors, int(usage.get("prompt_tokens", 0)),
                          time.perf_counter_ns() - started)

    def _no_tokenizer(self) -> ChatError:
        return ChatError(f"{self.model_name} is a remote model: its tokenizer is its upstream's, "
                         f"so its prompts cannot be counted or cut to fit here", "model")

    async def generate(self, request: UpstreamRequest) -> AsyncIterator[Event]:
        remote = self.entry.remote
        payload = {"model": remote.model, **request.payload, "stream": True,
                   "stream_options": {"include_usage": True}}
        answer, calls, thinking = RemoteAnswer(), _Calls(), False
        try:
            async with upstream_session() as session:
                response = await post(session, self.entry, request.path, payload)
                async with response:
                    async for chunk in chunks(response, self.entry):
                        if chunk.get("usage"):
                            answer.usage = chunk["usage"]
                        if isinstance(chunk.get("timings"), dict):
                            answer.timings = chunk["timings"]
                        for choice in chunk.get("choices") or ():
                            delta = choice.get("delta") or {}
                            text = ""
                            if reasoning := delta.get("reasoning_content") or delta.get(
                                    "reasoning"):
                                text, thinking = ("" if thinking else "<think>") + reasoning, True
                            if content := delta.get("content") or choice.get("text") or "":
                                text += ("</think>" if thinking else "") + content
                                thinking = False
                            calls.add(delta.get("tool_calls") or [])
                            answer.finish_reason = choice.get("finish_reason") or \
                                answer.finish_reason
                            if text:
                                self.tokens_generated += 1
                                yield answer.token(text)
        except ApiError as e:
            yield Failure(e.message, status=e.status)
            return
        except UpstreamError as e:
            yield Failure(str(e), status=502)
            return
        if tail := ("</think>" if thinking else "") + calls.text():
            yield replace(answer.token(tail), n_tokens=0)
        yield answer.done()


def _unit(values: list) -> tuple[float, ...]:
    """`values` scaled to length 1 (all zeros stay zeros), as the runner's vectors are."""
    floats = [float(v) for v in values]
    norm = math.sqrt(sum(v * v for v in floats))
    return tuple(v / norm for v in floats) if norm else tuple(floats)


def show(entry: ModelEntry) -> dict:
    """/api/show for a remote model: where it lives; there is no GGUF to describe."""
    remote = entry.remote
    assert remote is not None
    return {"license": "", "modelfile": f"# remote: {remote.model} at {remote.url}\n",
            "parameters": "", "template": "", "details": entry.details,
            "model_info": {"general.architecture": "remote", "remote.url": remote.url,
                           "remote.model": remote.model},
            "capabilities": ["completion", "chat"], "modified_at": entry.modified_at}
