"""Remote models: an OpenAI-compatible server (vLLM, SGLang, llama-server, another localllm)
that answers for a stored remote model, as an Engine (engine/seam.py) beside the local runner.
Here are the chat layer's request as the upstream's OpenAI request (`prepared`), and
`RemoteEngine`, which streams the upstream's answer back as the runner's typed events; the
response pipeline (api/respond.py) and every route's writer take it from there. The upstream's
client, and the capped, checked reading of its answers, are in remote_upstream.py.

Upstream failures become ApiErrors inside the client (502: refused, unreachable or a bad
answer; 504: no answer in time) and UpstreamError after the answer started; the engine turns
both into Failure events, so nothing here can take the daemon down.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import aiohttp
from localllm.engine.runner.protocol import Embeddings, EmbedRequest, Event, Failure
from localllm.modelstore.entries import shown_url
from localllm.modelstore.store import ModelEntry

from localllm.options import SamplingOptions

from .chat.errors import ChatError
from .chat.parse import call_id, make_parser
from .chat.request import ChatRequest, Prepared
from .chat.template import HERMES, THINK_TAGS
from .http_errors import ApiError
from .remote_upstream import (  # the upstream's client, as the engine and routes use it
    EMBEDDING_AT_MOST,
    EMBEDDINGS_AT_MOST,
    RemoteAnswer,
    UpstreamError,
    _Calls,
    _read_chunk,
    chunks,
    post,
    read_capped,
    upstream_session,
)


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
        where = f"remote model {self.model_name}"
        at_most = EMBEDDINGS_AT_MOST + EMBEDDING_AT_MOST * len(request.inputs)
        async with upstream_session() as session:
            response = await post(session, self.entry, "/embeddings", payload)
            async with response:
                try:
                    doc = json.loads(await read_capped(response, at_most, where))
                    rows = sorted(doc["data"], key=lambda row: int(row.get("index", 0)))
                    vectors = tuple(_unit(row["embedding"][:request.dimensions or None])
                                    for row in rows)
                    usage = doc.get("usage") or {}
                    prompt_tokens = int(usage.get("prompt_tokens", 0))
                except (TimeoutError, aiohttp.ClientError) as e:
                    raise ApiError(502, f"{where}: the upstream broke off its answer "
                                        f"({type(e).__name__})") from None
                except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                    raise ApiError(502, f"{where}: the upstream's /embeddings answer is not "
                                        f"OpenAI's list of embeddings ({type(e).__name__}: "
                                        f"{str(e)[:200]})") from None
        if len(vectors) != len(request.inputs):
            raise ApiError(502, f"{where}: the upstream sent {len(vectors)} embeddings for "
                                f"{len(request.inputs)} inputs")
        return Embeddings(vectors, prompt_tokens, time.perf_counter_ns() - started)

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
                        try:
                            texts, thinking = _read_chunk(chunk, answer, calls, thinking)
                        except (TypeError, ValueError, KeyError, AttributeError) as e:
                            raise UpstreamError(
                                f"remote model {self.model_name}: the upstream's answer is "
                                f"malformed ({type(e).__name__}: {str(e)[:200]})") from None
                        for text in texts:
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
    url = shown_url(remote.url)
    return {"license": "", "modelfile": f"# remote: {remote.model} at {url}\n",
            "parameters": "", "template": "", "details": entry.details,
            "model_info": {"general.architecture": "remote", "remote.url": url,
                           "remote.model": remote.model},
            "capabilities": ["completion", "chat"], "modified_at": entry.modified_at}
