"""OpenAI-compatible API (/v1/*): chat completions, completions and models, SSE streaming."""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web
from localllm.engine.runner.protocol import Done, Token
from localllm.modelstore.store import ModelEntry

from localllm.options import LoadOptions, SamplingOptions

from localllm.modelstore.custom import Customization
from ..chat.parse import Parsed
from ..chat.request import ChatRequest
from localllm.engine.runner.protocol import new_request_id
from ..state import STORE
from .common import (
    answer_limit,
    bad_request,
    body_options,
    find_model,
    get_bool,
    get_messages,
    get_number,
    get_str,
    get_tool_choice,
    get_tools,
    has_images,
    read_json,
    requested_model,
)
from .respond import Part, Writer, respond

# OpenAI's reasoning efforts -> the chat layer's think levels ("none" turns thinking off).
EFFORTS = {"none": False, "minimal": "low", "low": "low", "medium": "medium", "high": "high",
           "xhigh": "high"}


def think_from_effort(effort, label: str) -> bool | str | None:
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(f"{label} must be one of {', '.join(repr(e) for e in EFFORTS)}",
                          label)
    return EFFORTS[effort]


def output_format(spec, schema, param: str, schema_name: str, spec_name: str = ""):
    """An OpenAI structured-output spec (`{"type": "text" | "json_object" | "json_schema"}`,
    its `schema` found by the caller: the two APIs keep it in different places) -> the chat
    layer's format: None, "json" or the schema. A 400 naming `param` when it is neither."""
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        if not isinstance(schema, dict):
            raise bad_request(f"{schema_name} must be a JSON schema object", param)
        return schema
    raise bad_request(f"{spec_name or param}.type must be 'text', 'json_object' or "
                      "'json_schema'", param)


routes = web.RouteTableDef()


# OpenAI's names for the table's options (max_completion_tokens wins over max_tokens).
OPENAI_NAMES = {"max_completion_tokens": "num_predict", "max_tokens": "num_predict"}


def openai_options(body: dict, stored: dict | None = None, chat: bool = True
                   ) -> tuple[SamplingOptions, LoadOptions]:
    n = get_number(body, "n", int, 1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    answer_limit(body, "max_completion_tokens")
    answer_limit(body, "max_tokens", 1 if chat else 0)  # completions: 0 scores the prompt
    return body_options(body, OPENAI_NAMES, stored)


def finish_reason(done: Done, parsed_calls: bool) -> str:
    if parsed_calls:
        return "tool_calls"
    # a loop cut short is an answer that did not end: said as OpenAI says a cut ("length")
    return "length" if done.done_reason in ("length", "loop") else "stop"


def usage(done: Done) -> dict:
    # prompt_tokens counts the whole prompt, as OpenAI bills it; the cached part is reported too.
    out = {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.eval_count,
           "total_tokens": done.prompt_tokens + done.eval_count,
           "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}
    if done.drafted is not None:
        # OpenAI's predicted-output fields are the same numbers: draft tokens the model took
        # and those it threw away; `draft` is the Ollama side's stats.draft.
        accepted = done.draft_accepted or 0
        out["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                            "rejected_prediction_tokens": done.drafted - accepted}
        out["draft"] = {"drafted": done.drafted, "accepted": accepted}
    return out


def parse_response_format(body: dict):
    """OpenAI `response_format` -> the chat layer's `format` (None, "json" or a schema)."""
    value = body.get("response_format")
    if value is None:
        return None
    spec = value.get("json_schema") if isinstance(value, dict) else None
    return output_format(value, spec.get("schema") if isinstance(spec, dict) else None,
                         "response_format", "response_format.json_schema.schema")


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """Chat: `logprobs: true` with `top_logprobs: N`; completions: `logprobs: N`."""
    if chat:
        if not get_bool(body, "logprobs", False):
            if body.get("top_logprobs") is not None:
                raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
            return None
        return get_number(body, "top_logprobs", int, 0, 20) or 0
    return get_number(body, "logprobs", int, 0, 5)


def parse_think(body: dict):
    return think_from_effort(get_str(body, "reasoning_effort"), "reasoning_effort")


def tool_calls_json(calls, streamed: bool) -> list[dict]:
    out = []
    for call in calls:
        item = {"id": call.id, "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        if streamed:
            item["index"] = call.index
        out.append(item)
    return out


def chat_logprobs(entries: list[dict]) -> dict:
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": e.get("top_logprobs", [])} for e in entries]}


def completion_logprobs(entries: list[dict], offset: int = 0) -> dict:
    """The legacy completions shape: parallel lists. With `echo` the prompt's tokens come
    first, the very first with logprob None (as OpenAI, and lm-evaluation-harness reads it);
    a BOS the tokenizer added stands at offset 0 and takes no characters of the text."""
    tokens = [e["token"] for e in entries]
    offsets, at = [], offset
    for entry in entries:
        offsets.append(at)
        if not entry.get("added"):
            at += len(entry["token"])
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["logprob"] is None
                             else {t["token"]: t["logprob"] for t in e.get("top_logprobs", [])}
                             for e in entries],
            "text_offset": offsets}


class OpenAIWriter(Writer):
    """OpenAI's answer to /v1/chat/completions (`chat`: a message, or deltas) and
    /v1/completions (text): one object, or SSE chunks ending in [DONE]."""

    def __init__(self, body: dict, model: str, request: ChatRequest, chat: bool):
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise bad_request("field 'stream_options' must be an object", "stream_options")
        self.include_usage = bool(stream_options.get("include_usage"))
        self.request, self.chat = request, chat
        self.want_logprobs = request.logprobs is not None
        self.base = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model,
                     "system_fingerprint": "localllm"}
        self.first, self.any_calls, self.text_offset = True, False, 0

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        reason = finish_reason(done, bool(parsed.tool_calls))
        if self.chat:
            message: dict = {"role": "assistant",
                             "content": parsed.content or (None if parsed.tool_calls else "")}
            if parsed.thinking:
                message["reasoning_content"] = parsed.thinking
            if parsed.tool_calls:
                message["tool_calls"] = tool_calls_json(parsed.tool_calls, False)
            choice = {"index": 0, "message": message, "finish_reason": reason,
                      "logprobs": chat_logprobs(logprobs) if self.want_logprobs else None}
        else:
            text = parsed.content
            if self.request.echo:  # the prompt, then the answer (max_tokens 0: none)
                text = (self.request.prompt or "") + text
                logprobs = [*(done.prompt_logprobs or ()), *logprobs]
            choice = {"index": 0, "text": text, "finish_reason": reason,
                      "logprobs": completion_logprobs(logprobs) if self.want_logprobs
                      else None}
        base = self.base
        return {"id": base["id"], "object": "chat.completion" if self.chat else "text_completion",
                "created": base["created"], "model": base["model"], "choices": [choice],
                "usage": usage(done), "system_fingerprint": "localllm"}

    async def send(self, data) -> None:
        payload = data if isinstance(data, str) else json.dumps(data)
        await self.write(f"data: {payload}\n\n".encode())

    def choice(self, parsed: Parsed, reason: str | None, logprobs: list[dict]) -> dict:
        if not self.chat:
            out = {"index": 0, "text": parsed.content, "finish_reason": reason,
                   "logprobs": completion_logprobs(logprobs, self.text_offset)
                   if self.want_logprobs else None}
            self.text_offset += len(parsed.content)
            return out
        delta: dict = {"role": "assistant"} if self.first else {}
        if parsed.content or not (parsed.thinking or parsed.tool_calls):
            delta["content"] = parsed.content
        if parsed.thinking:
            delta["reasoning_content"] = parsed.thinking
        if parsed.tool_calls:
            delta["tool_calls"] = tool_calls_json(parsed.tool_calls, True)
        return {"index": 0, "delta": delta, "finish_reason": reason,
                "logprobs": chat_logprobs(logprobs) if self.want_logprobs and logprobs
                else None}

    async def part(self, part: Part) -> None:
        event = part.event
        if isinstance(event, Token):
            self.any_calls = self.any_calls or bool(part.parsed.tool_calls)
            await self.send({**self.base, "choices": [self.choice(part.parsed, None,
                                                                  part.logprobs)]})
            self.first = False
        else:  # a long prompt is being read: an SSE comment, which clients skip
            await self.write(f": prompt {event.prompt_read}/{event.prompt_total}\n\n".encode())

    async def done(self, part: Part) -> None:
        self.any_calls = self.any_calls or bool(part.parsed.tool_calls)
        if part.parsed:
            await self.send({**self.base, "choices": [self.choice(part.parsed, None, [])]})
            self.first = False
        await self.send({**self.base, "choices": [self.choice(
            Parsed(), finish_reason(part.event, self.any_calls), [])]})
        if self.include_usage:
            await self.send({**self.base, "choices": [], "usage": usage(part.event)})
        await self.send("[DONE]")

    async def error(self, message: str) -> None:
        await self.send({"error": {"message": message, "type": "server_error", "param": None,
                                   "code": None}})


async def _complete(request: web.Request, body: dict, entry: ModelEntry, custom: Customization,
                    chat_request: ChatRequest, chat: bool) -> web.StreamResponse:
    writer = OpenAIWriter(body, entry.name.tagged, chat_request, chat)
    return await respond(request, chat_request, writer, entry=entry, custom=custom,
                         stream=get_bool(body, "stream", False))


async def read_chat(request: web.Request,
                    body: dict) -> tuple[ModelEntry, Customization, ChatRequest]:
    """A chat completions body, translated (also what its token count renders)."""
    entry, custom = await requested_model(request, body)
    sampling, load = openai_options(body, custom.parameters)
    images: list = []
    chat_request = ChatRequest(
        id=new_request_id(), model_name=entry.name.tagged, options=sampling, load=load,
        messages=get_messages(body, images), tools=get_tools(body),
        tool_choice=get_tool_choice(body), format=parse_response_format(body),
        think=parse_think(body), has_images=has_images(body), images=tuple(images),
        logprobs=parse_logprobs(body, chat=True))
    return entry, custom, chat_request


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    entry, custom, chat_request = await read_chat(request, body)
    return await _complete(request, body, entry, custom, chat_request, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("field 'prompt' must be a string", "prompt")
    echo = get_bool(body, "echo", False)
    if echo and get_bool(body, "stream", False):
        raise bad_request("echo is answered whole: leave out stream (or set it false)", "echo")
    entry, custom = await requested_model(request, body)
    sampling, load = openai_options(body, custom.parameters, chat=False)
    chat_request = ChatRequest(
        id=new_request_id(), model_name=entry.name.tagged, options=sampling, load=load,
        prompt=prompt, raw=True,
        suffix=get_str(body, "suffix") or None, logprobs=parse_logprobs(body, chat=False),
        echo=echo)
    return await _complete(request, body, entry, custom, chat_request, chat=False)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    data = [{"id": e.name.tagged, "object": "model", "owned_by": "library",
             "created": _created(e.modified_at)} for e in request.app[STORE].list()]
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{name:.+}")
async def get_model(request: web.Request) -> web.Response:
    entry = find_model(request, request.match_info["name"])
    return web.json_response({"id": entry.name.tagged, "object": "model", "owned_by": "library",
                              "created": _created(entry.modified_at)})


def _created(iso_time: str) -> int:
    import datetime as dt

    return int(dt.datetime.fromisoformat(iso_time).timestamp())
