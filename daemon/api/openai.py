"""OpenAI-compatible API (/v1/*): chat completions, completions and models, SSE streaming."""

from __future__ import annotations

import json
import time
import uuid

from aiohttp import web

from .. import remote
from ..runner.protocol import Done, Failure, GenerationRequest, Progress, SamplingOptions, Token
from ..generation import collect, find_model, first_event, generate
from ..runner.process import new_request_id
from ..state import STORE
from .common import (
    bad_request,
    get_bool,
    get_messages,
    get_number,
    get_stop,
    get_str,
    read_json,
)

routes = web.RouteTableDef()


def parse_sampling(body: dict) -> SamplingOptions:
    defaults = SamplingOptions()
    max_tokens = get_number(body, "max_completion_tokens", int, 0)
    if max_tokens is None:
        max_tokens = get_number(body, "max_tokens", int, 0)
    temperature = get_number(body, "temperature", float, 0, 2)
    top_p = get_number(body, "top_p", float, 0, 1)
    presence = get_number(body, "presence_penalty", float, -2, 2)
    frequency = get_number(body, "frequency_penalty", float, -2, 2)
    n = get_number(body, "n", int, 1)
    if n not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    return SamplingOptions(
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=defaults.top_p if top_p is None else top_p,
        presence_penalty=presence or 0.0,
        frequency_penalty=frequency or 0.0,
        seed=get_number(body, "seed", int),
        num_predict=-1 if max_tokens is None else max_tokens,
        stop=get_stop(body),
    )


def finish_reason(done: Done) -> str:
    return "length" if done.done_reason == "length" else "stop"


def usage(done: Done) -> dict:
    # prompt_tokens counts the whole prompt, as OpenAI bills it; the cached part is reported too.
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.eval_count,
            "total_tokens": done.prompt_tokens + done.eval_count,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


async def _complete(request: web.Request, body: dict, gen_request: GenerationRequest,
                    chat: bool) -> web.StreamResponse:
    app = request.app
    entry = find_model(app, get_str(body, "model", required=True))
    stream = get_bool(body, "stream", False)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise bad_request("field 'stream_options' must be an object", "stream_options")
    include_usage = bool(stream_options.get("include_usage"))
    model = str(entry.name)
    prefix = "chatcmpl" if chat else "cmpl"
    ident = f"{prefix}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"

    def choice(text: str, reason: str | None, first: bool = False) -> dict:
        if chat and stream:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            return {"index": 0, "delta": delta, "finish_reason": reason}
        if chat:
            return {"index": 0, "message": {"role": "assistant", "content": text},
                    "finish_reason": reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

    async with generate(app, entry, gen_request, None, {}) as gen:
        if not stream:
            text, done = await collect(gen)
            return web.json_response({
                "id": ident, "object": obj, "created": created, "model": model,
                "choices": [choice(text, finish_reason(done))],
                "usage": usage(done), "system_fingerprint": "localllm",
            })
        first_event_ = await first_event(gen)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        async def send(data) -> None:
            payload = data if isinstance(data, str) else json.dumps(data)
            await response.write(f"data: {payload}\n\n".encode())

        event, first = first_event_, True
        try:
            while True:
                base = {"id": ident, "object": chunk_obj, "created": created, "model": model,
                        "system_fingerprint": "localllm"}
                if isinstance(event, Token):
                    await send({**base, "choices": [choice(event.text, None, first)]})
                    first = False
                elif isinstance(event, Progress):  # an SSE comment: clients skip it
                    await response.write(
                        f": prompt {event.prompt_read}/{event.prompt_total}\n\n".encode())
                elif isinstance(event, Failure):
                    await send({"error": {"message": event.message, "type": "server_error",
                                          "param": None, "code": None}})
                    break
                else:
                    await send({**base, "choices": [choice("", finish_reason(event), first)]})
                    if include_usage:
                        await send({**base, "choices": [], "usage": usage(event)})
                    await send("[DONE]")
                    break
                event = await anext(gen.events)
        except ConnectionError:
            return response  # client went away: leaving `generate` cancels the runner
        await response.write_eof()
        return response


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if (remote_model := remote.remote_entry(request.app, body)) is not None:
        return await remote.openai(request, body, remote_model)
    gen_request = GenerationRequest(id=new_request_id(), messages=get_messages(body),
                                    options=parse_sampling(body))
    return await _complete(request, body, gen_request, chat=True)


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if (remote_model := remote.remote_entry(request.app, body)) is not None:
        return await remote.openai(request, body, remote_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("field 'prompt' must be a string", "prompt")
    gen_request = GenerationRequest(id=new_request_id(), prompt=prompt, raw=True,
                                    options=parse_sampling(body))
    return await _complete(request, body, gen_request, chat=False)


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    data = [{"id": str(e.name), "object": "model", "owned_by": "library",
             "created": _created(e.modified_at)} for e in request.app[STORE].list()]
    return web.json_response({"object": "list", "data": data})


@routes.get("/v1/models/{name:.+}")
async def get_model(request: web.Request) -> web.Response:
    entry = find_model(request.app, request.match_info["name"])
    return web.json_response({"id": str(entry.name), "object": "model", "owned_by": "library",
                              "created": _created(entry.modified_at)})


def _created(iso_time: str) -> int:
    import datetime as dt

    return int(dt.datetime.fromisoformat(iso_time).timestamp())
