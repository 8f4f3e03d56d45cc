"""OpenAI's Responses API (/v1/responses), as Codex and Copilot CLI speak it.

A request becomes the one `ChatRequest`: `instructions` and the input items become HF-shaped
messages (function_call / custom_tool_call -> an assistant's tool_calls, their outputs -> tool
messages, reasoning items -> reasoning_content), `function` tools pass as they are, `custom`
tools (free-form input) are offered as tools taking one string `input` and come back as
custom_tool_call items, a `namespace` tool's tools are offered one by one (their calls come back
with the `namespace` field), and hosted tools this server cannot run (web_search, file_search,
code_interpreter, computer use, image generation, mcp, local_shell...) and `defer_loading` tools
are left out of the prompt. Answers are kept in memory, bounded, for `previous_response_id` and GET.
Accepted and ignored: `metadata`, `user`, `include`, `prompt_cache_key`, `service_tier`,
`reasoning.summary`, `text.verbosity`, encrypted reasoning content.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web
from localllm.engine.runner.protocol import Done, Progress
from localllm.modelstore.store import ModelEntry

from ..chat.compaction import summarising, summary_text
from localllm.modelstore.custom import Customization
from ..chat.parse import Parsed, ToolCall
from ..chat.request import ChatRequest
from localllm.engine.runner.protocol import new_request_id
from .common import (
    ApiError,
    answer_limit,
    bad_request,
    body_options,
    get_bool,
    get_str,
    kept_calls,
    message_images,
    read_json,
    requested_model,
)
from .respond import Part, Writer, respond, served_model
from .responses_input import (
    ToolSet,
    input_messages,
    reasoning_effort,
    responses_tool_choice,
    responses_tools,
    text_format,
)

routes = web.RouteTableDef()

# The Responses names for the table's options; temperature and top_p share the table's.
RESPONSES_NAMES = {"max_output_tokens": "num_predict"}


# ---- stored responses ----------------------------------------------------------------------
class Stored:
    """One stored answer, held as its compact JSON: what is counted against the bound is what
    stays resident (the parsed objects of a 10 MiB `metadata` took about 250 MiB)."""

    def __init__(self, response: dict, history: tuple[dict, ...]) -> None:
        self.data = json.dumps([response, history], separators=(",", ":")).encode()

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def response(self) -> dict:  # what GET answers
        return json.loads(self.data)[0]

    @property
    def history(self) -> tuple[dict, ...]:  # the conversation so far, without instructions
        return tuple(json.loads(self.data)[1])


class StoredResponses:
    """Answers kept for previous_response_id and GET, oldest dropped first past either bound.
    They live in the daemon's memory only: a restart forgets them."""

    def __init__(self, max_count: int = 1000, max_bytes: int = 256 << 20):
        self.max_count, self.max_bytes = max_count, max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.size = 0

    def put(self, response: dict, history: tuple[dict, ...]) -> None:
        stored = Stored(response, history)
        self.items[response["id"]] = stored
        self.size += stored.size
        while len(self.items) > self.max_count or (self.size > self.max_bytes
                                                   and len(self.items) > 1):
            _, dropped = self.items.popitem(last=False)
            self.size -= dropped.size

    def get(self, response_id: str, param: str | None = None) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise ApiError(404, f"response '{response_id}' is not stored here: it was sent with "
                           f"store false, or dropped (the daemon keeps the latest "
                           f"{self.max_count} responses, at most {self.max_bytes >> 20} MiB, "
                           f"until it restarts); send the whole conversation as input",
                           param, code="response_not_found")
        return stored

    def delete(self, response_id: str) -> None:
        self.size -= self.get(response_id).size
        del self.items[response_id]


STORED = web.AppKey("stored_responses", StoredResponses)


# ---- request -------------------------------------------------------------------------------
@dataclass
class Turn:
    """One Responses request, translated."""
    entry: ModelEntry
    custom: Customization
    chat: ChatRequest
    history: tuple[dict, ...]  # the conversation before the answer, without instructions
    tools: ToolSet
    parallel: bool
    store: bool
    echo: dict  # the request's fields the response object repeats


TRUNCATIONS = ("auto", "disabled")


async def read_turn(request: web.Request, body: dict) -> Turn:
    entry, custom = await requested_model(request, body)
    answer_limit(body, "max_output_tokens")
    if body.get("truncation") not in (None, *TRUNCATIONS):
        raise bad_request("truncation must be 'auto' or 'disabled'", "truncation")
    sampling, load = body_options(body, RESPONSES_NAMES, custom.parameters)
    previous = get_str(body, "previous_response_id")
    history = request.app[STORED].get(previous, "previous_response_id").history \
        if previous else ()
    earlier = frozenset(call.get("id") for m in history for call in m.get("tool_calls") or ())
    tools = responses_tools(body)
    history = (*history, *input_messages(body.get("input"), earlier, tools))
    if not history:
        raise bad_request("field 'input' is missing or empty", "input")
    instructions = get_str(body, "instructions")
    messages, images = message_images(
        (({"role": "system", "content": instructions},) if instructions else ()) + history)
    think = reasoning_effort(body)
    if think and entry.remote is None and not (
            await served_model(entry, custom)).style.thinking:
        think = None  # Codex always sends an effort: a model that cannot think just answers
    parallel = get_bool(body, "parallel_tool_calls", True)
    chat = ChatRequest(
        id=new_request_id(), model_name=entry.name.tagged, options=sampling, load=load,
        messages=messages, tools=tools.tools, tool_choice=responses_tool_choice(body),
        format=text_format(body), think=think,
        has_images=bool(images), images=images, workload_hint="/v1/responses")
    echo = {"instructions": instructions, "previous_response_id": previous,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice", "auto"),
            "parallel_tool_calls": parallel, "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "max_output_tokens": body.get("max_output_tokens"),
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"),
                          "summary": None},
            "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": body.get("truncation") or "disabled",
            "metadata": body.get("metadata") or {}, "user": body.get("user")}
    return Turn(entry, custom, chat, history, tools, parallel,
                get_bool(body, "store", True), echo)


# ---- answer --------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}] if status == "completed" else []}


def call_item(call: ToolCall, tools: ToolSet, status: str = "completed") -> dict:
    """A call as its item; a namespace's tool is named as the namespace lists it, with the
    namespace beside it (as OpenAI's items carry it, and Codex routes the call by both)."""
    done = status == "completed"
    namespace, name = tools.namespaced.get(call.name, (None, call.name))
    where = {"namespace": namespace} if namespace is not None else {}
    if call.name in tools.custom:
        value = call.arguments.get("input")
        text = value if isinstance(value, str) else json.dumps(call.arguments)
        return {"type": "custom_tool_call", "id": _id("ctc"), "call_id": call.id,
                "name": name, **where, "input": text if done else "", "status": status}
    return {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": name,
            **where, "arguments": json.dumps(call.arguments) if done else "",
            "status": status}


def output_items(parsed: Parsed, turn: Turn) -> list[dict]:
    calls = kept_calls(parsed.tool_calls, turn.parallel)
    items = [reasoning_item(_id("rs"), parsed.thinking)] if parsed.thinking else []
    if parsed.content.strip() or (parsed.content and not calls):
        items.append(message_item(_id("msg"), parsed.content))
    return items + [call_item(call, turn.tools) for call in calls]


def usage(done: Done) -> dict:
    # input_tokens counts the whole prompt, as OpenAI bills it; the cached part is reported too.
    return {"input_tokens": done.prompt_tokens,
            "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.eval_count, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.eval_count}


def answer_message(parsed: Parsed, turn: Turn) -> dict:
    """The answer as the next request's history reads it."""
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.thinking:
        message["reasoning_content"] = message["thinking"] = parsed.thinking
    calls = kept_calls(parsed.tool_calls, turn.parallel)
    if calls:
        message["tool_calls"] = [{"type": "function", "id": c.id, "function": {
            "name": c.name, "arguments": c.arguments}} for c in calls]
    return message


class Response:
    """The response object of one turn, from in_progress to its end; it stores itself."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.body = {"id": _id("resp"), "object": "response", "created_at": int(time.time()),
                     "status": "in_progress", "model": turn.entry.name.tagged, "output": [],
                     "error": None, "incomplete_details": None, **turn.echo,
                     "store": turn.store, "usage": None}

    def finish(self, app: web.Application, parsed: Parsed, done: Done,
               output: list[dict]) -> dict:
        incomplete = done.done_reason == "length"
        self.body.update(output=output, usage=usage(done),
                         status="incomplete" if incomplete else "completed",
                         incomplete_details={"reason": "max_output_tokens"} if incomplete
                         else None)
        if self.turn.store:
            app[STORED].put(self.body, (*self.turn.history, answer_message(parsed, self.turn)))
        return self.body

    def fail(self, message: str) -> dict:
        self.body.update(status="failed", error={"code": "server_error", "message": message})
        return self.body


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    turn = await read_turn(request, body)
    writer = ResponsesWriter(request.app, turn)
    chat = turn.chat
    if compaction_asked(body):  # Codex's compaction: the answer is one compaction item
        turn.store = False
        chat, writer = summarising(chat), CompactionWriter(request.app, turn)
    return await respond(request, chat, writer, entry=turn.entry, custom=turn.custom,
                         stream=get_bool(body, "stream", False),
                         truncate=body.get("truncation") != "disabled")


@routes.get("/v1/responses/{id}")
async def get_response(request: web.Request) -> web.Response:
    return web.json_response(request.app[STORED].get(request.match_info["id"]).response)


@routes.delete("/v1/responses/{id}")
async def delete_response(request: web.Request) -> web.Response:
    response_id = request.match_info["id"]
    request.app[STORED].delete(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


class ResponsesWriter(Writer):
    """The Responses answer: the response object, or its SSE events, output items opened,
    filled and closed in order, each event numbered."""

    def __init__(self, app: web.Application, turn: Turn):
        self.app, self.turn = app, turn
        self.answer = Response(turn)
        self.whole_text = Parsed()  # all of the answer, for the stored history
        self.sequence = 0
        self.output: list[dict] = []  # items done
        self.open: dict | None = None  # the reasoning or message item being written
        self.text = ""

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        return self.answer.finish(self.app, parsed, done, output_items(parsed, self.turn))

    async def send(self, kind: str, data: dict) -> None:
        payload = json.dumps({"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        await self.write(f"event: {kind}\ndata: {payload}\n\n".encode())

    def _at(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    async def close_item(self) -> None:
        item = self.open
        if item is None:
            return
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], self.text)
            part = {"type": "reasoning_text", "text": self.text}
            await self.send("response.reasoning_text.done",
                            {**self._at(), "content_index": 0, "text": self.text})
        else:
            done = message_item(item["id"], self.text)
            part = done["content"][0]
            await self.send("response.output_text.done",
                            {**self._at(), "content_index": 0, "text": self.text,
                             "logprobs": []})
        await self.send("response.content_part.done",
                        {**self._at(), "content_index": 0, "part": part})
        await self.send("response.output_item.done",
                        {"output_index": len(self.output), "item": done})
        self.output.append(done)
        self.open, self.text = None, ""

    async def add_text(self, kind: str, text: str) -> None:
        """Reasoning or answer text, appended to the open item of that kind (else a new one)."""
        if self.open is None or self.open["type"] != kind:
            await self.close_item()
            if kind == "reasoning":
                self.open = reasoning_item(_id("rs"), "", "in_progress")
                part = {"type": "reasoning_text", "text": ""}
            else:
                self.open = message_item(_id("msg"), "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            await self.send("response.output_item.added",
                            {"output_index": len(self.output), "item": self.open})
            await self.send("response.content_part.added",
                            {**self._at(), "content_index": 0, "part": part})
        self.text += text
        event = ("response.reasoning_text.delta" if kind == "reasoning"
                 else "response.output_text.delta")
        extra = {} if kind == "reasoning" else {"logprobs": []}
        await self.send(event, {**self._at(), "content_index": 0, "delta": text, **extra})

    async def call(self, call: ToolCall) -> None:
        await self.close_item()
        item = call_item(call, self.turn.tools, "in_progress")
        done = {**item, **call_item(call, self.turn.tools), "id": item["id"]}
        at = {"item_id": item["id"], "output_index": len(self.output)}
        await self.send("response.output_item.added", {"output_index": len(self.output),
                                                       "item": item})
        if item["type"] == "custom_tool_call":
            await self.send("response.custom_tool_call_input.delta",
                            {**at, "delta": done["input"]})
            await self.send("response.custom_tool_call_input.done",
                            {**at, "input": done["input"]})
        else:
            await self.send("response.function_call_arguments.delta",
                            {**at, "delta": done["arguments"]})
            await self.send("response.function_call_arguments.done",
                            {**at, "arguments": done["arguments"]})
        await self.send("response.output_item.done", {"output_index": len(self.output),
                                                      "item": done})
        self.output.append(done)

    async def start(self, first: Part) -> None:
        await self.send("response.created", {"response": self.answer.body})
        await self.send("response.in_progress", {"response": self.answer.body})

    async def part(self, part: Part) -> None:
        parsed = part.parsed
        self.whole_text.add(parsed)
        if isinstance(part.event, Progress):  # an SSE comment: clients skip it
            await self.write(f": prompt {part.event.prompt_read}/"
                             f"{part.event.prompt_total}\n\n".encode())
        if parsed.thinking:
            await self.add_text("reasoning", parsed.thinking)
        if parsed.content:
            await self.add_text("message", parsed.content)
        for call in kept_calls(parsed.tool_calls, self.turn.parallel):
            await self.call(call)

    async def done(self, part: Part) -> None:
        await self.part(part)
        await self.close_item()
        # Also when the answer ran out of tokens: the response's status says so, and the
        # SDK's stream reader (as Codex's) finishes only on response.completed.
        await self.send("response.completed", {"response": self.answer.finish(
            self.app, self.whole_text, part.event, self.output)})

    async def error(self, message: str) -> None:
        await self.close_item()
        await self.send("response.failed", {"response": self.answer.fail(message)})


# ---- compaction ----------------------------------------------------------------------------
def compaction_asked(body: dict) -> bool:
    """Whether `input` ends with a `compaction_trigger` item (Codex's compaction request)."""
    items = body.get("input")
    return isinstance(items, list) and bool(items) and isinstance(items[-1], dict) \
        and items[-1].get("type") == "compaction_trigger"


def compaction_item(parsed: Parsed) -> dict:
    """The model's summary as the item the client keeps in place of the conversation (the
    text is plain: this server reads it back, nobody else does)."""
    return {"type": "compaction", "id": _id("cmp"),
            "encrypted_content": summary_text(parsed.content, parsed.thinking)}


class CompactionWriter(ResponsesWriter):
    """The answer to a compaction request: one `compaction` item holding the summary, written
    once the summary is whole, and the usage of the turn that wrote it."""

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        return self.answer.finish(self.app, parsed, done, [compaction_item(parsed)])

    async def part(self, part: Part) -> None:
        self.whole_text.add(part.parsed)

    async def done(self, part: Part) -> None:
        self.whole_text.add(part.parsed)
        item = compaction_item(self.whole_text)
        await self.send("response.output_item.added", {"output_index": 0, "item": item})
        await self.send("response.output_item.done", {"output_index": 0, "item": item})
        await self.send("response.completed", {"response": self.answer.finish(
            self.app, self.whole_text, part.event, [item])})
