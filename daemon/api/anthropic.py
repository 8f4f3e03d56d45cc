"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as Claude Code speaks it.

A request becomes the one `ChatRequest`: `system` and the messages' blocks become HF-shaped
messages (tool_use -> an assistant's tool_calls, tool_result -> a tool message, thinking ->
reasoning_content), `tools` with `input_schema` become function tools, and the sampling fields go
through the option table. The answer is a `message` with content blocks, or Anthropic's SSE
events. `output_config.format` (a JSON schema) constrains the answer as `format` does.
Accepted and ignored: `metadata`, `cache_control`, `service_tier`, `output_config.effort`,
`container`, `speed` and the other fields the chat layer has no use for, a thinking block's
`signature`, `redacted_thinking` blocks, `thinking.budget_tokens`, and Anthropic's own server and
versioned tools (web_search_..., bash_..., text_editor_...), which are left out of the prompt.
Tools with `defer_loading: true` are not rendered either: a tool search tool finds them, run by
this server (anthropic_search.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from aiohttp import web
from localllm.modelstore.store import ModelEntry

from ..chat.custom import Customization
from ..chat.parse import Parsed, ToolCall
from ..chat.request import ChatRequest
from ..runner.process import new_request_id
from ..runner.protocol import Done, Progress, Token
from .common import (
    answer_limit,
    bad_request,
    body_options,
    get_bool,
    kept_calls,
    local_model,
    message_images,
    read_json,
)
from .anthropic_search import SearchRun, Tools, anthropic_tools, result_text
from .respond import Part, Writer, served_model, count_prompt_tokens, respond

routes = web.RouteTableDef()

# Anthropic's names for the table's options; temperature, top_p and top_k share the table's.
ANTHROPIC_NAMES = {"max_tokens": "num_predict", "stop_sequences": "stop"}

# ---- request -------------------------------------------------------------------------------
def _blocks(content, where: str) -> list[dict]:
    """A content field as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where} must be a string or a list of content blocks", "messages")
    return content


def _text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", "messages")
    return text


def image_from_block(block: dict, where: str) -> str:
    """An `image` block as the chat layer carries images: base64 data (or the URL it names)."""
    source = block.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return source["data"]
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return source["url"]
    raise bad_request(f"{where}.source must be {{type: base64, media_type, data}} or "
                      f"{{type: url, url}}", "messages")


def system_prompt(body: dict) -> str | None:
    system = body.get("system")
    if system is None:
        return None
    blocks = _blocks(system, "system")
    return "\n\n".join(_text(b, f"system[{i}]") for i, b in enumerate(blocks)
                       if b.get("type") == "text")


def _tool_result(block: dict, where: str, names: dict[str, str], tools: Tools) -> dict:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise bad_request(f"{where}.tool_use_id must be a string", "messages")
    content = block.get("content", "")
    texts, images, referenced = [], [], []
    for j, part in enumerate(_blocks(content, f"{where}.content")):
        if part.get("type") == "text":
            texts.append(_text(part, f"{where}.content[{j}]"))
        elif part.get("type") == "image":
            images.append(image_from_block(part, f"{where}.content[{j}]"))
        elif part.get("type") == "tool_reference":  # a search the client ran: the tools found
            referenced.append(str(part.get("tool_name")))
    if referenced:
        texts.append(tools.deferred.definitions(referenced))
    text = "\n".join(texts)
    if block.get("is_error"):  # templates have no error flag: the model reads it in the text
        text = f"Error: {text}"
    if use_id not in names:
        raise bad_request(f"{where}.tool_use_id {use_id!r} answers no tool_use block before "
                          f"it: each tool_result follows the assistant's tool_use of that id",
                          "messages")
    out = {"role": "tool", "content": text, "tool_call_id": use_id, "name": names[use_id]}
    if images:
        out["images"] = images
    return out


def _user(i: int, blocks: list[dict], names: dict[str, str], tools: Tools) -> list[dict]:
    """A user turn: its tool results first (as tool messages), then its text and images."""
    results, texts, images = [], [], []
    for j, block in enumerate(blocks):
        where, kind = f"messages[{i}].content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "image":
            images.append(image_from_block(block, where))
        elif kind == "tool_result":
            results.append(_tool_result(block, where, names, tools))
        else:
            raise bad_request(f"{where}: a user block of type {kind!r} is not supported "
                              f"(text, image and tool_result are)", "messages")
    if texts or images or not results:
        user: dict = {"role": "user", "content": "\n".join(texts)}
        if images:
            user["images"] = images
        results.append(user)
    return results


def _call(block: dict, where: str, names: dict[str, str]) -> dict:
    """A tool_use (or a server_tool_use of the tool search) as the chat layer's tool call."""
    name, use_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(use_id, str):
        raise bad_request(f"{where} needs an id and a name", "messages")
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input must be an object", "messages")
    names[use_id] = name
    return {"type": "function", "id": use_id, "function": {"name": name, "arguments": arguments}}


def _assistant(where: str, blocks: list[dict], names: dict[str, str], tools: Tools
               ) -> list[dict]:
    """An assistant turn as messages: one, unless the server ran a tool search in it; then the
    search call ends one assistant message, its result is a tool message (the tools found),
    and what the model wrote after it is the next assistant message."""
    out: list[dict] = []
    texts, thinking, calls = [], [], []

    def close() -> None:
        message: dict = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = list(calls)
        if thinking:
            message["reasoning_content"] = message["thinking"] = "\n".join(thinking)
        out.append(message)
        texts.clear(), thinking.clear(), calls.clear()

    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "tool_use" or (kind == "server_tool_use"
                                    and block.get("name") in tools.searches):
            calls.append(_call(block, at, names))
        elif kind == "tool_search_tool_result":
            use_id = block.get("tool_use_id")
            if use_id not in names:
                raise bad_request(f"{at}.tool_use_id {use_id!r} answers no server_tool_use "
                                  f"block before it", "messages")
            close()
            out.append({"role": "tool", "content": result_text(block, tools.deferred),
                        "tool_call_id": use_id, "name": names[use_id]})
        elif kind in ("redacted_thinking", "server_tool_use", "web_search_tool_result"):
            continue  # nothing this server can read or run
        else:
            raise bad_request(f"{at}: an assistant block of type {kind!r} is not supported "
                              f"(text, thinking and tool_use are)", "messages")
    if texts or thinking or calls or not out:
        close()
    return out


def assistant_turns(blocks: list[dict], tools: Tools) -> list[dict]:
    """The blocks of an answer under way as the messages the next generation reads (the same
    messages the client's next request makes of them)."""
    return _assistant("content", blocks, {}, tools)


ROLES = ("user", "assistant", "system")


def anthropic_messages(body: dict, tools: Tools | None = None) -> tuple[dict, ...]:
    """`system` and `messages` in the HF shape the chat layer renders (see get_messages). A
    system message among `messages` (Claude Code sends them) stays where it is: the chat layer
    places it as the model's template allows (chat/roles.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("field 'messages' must be a non-empty list of {role, content} "
                          "objects", "messages")
    tools = tools if tools is not None else anthropic_tools(body)
    system = system_prompt(body)
    out = [{"role": "system", "content": system}] if system else []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that follow
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] must be an object with role 'user', "
                              f"'assistant' or 'system'", "messages")
        blocks = _blocks(message.get("content", ""), f"messages[{i}].content")
        if message["role"] == "system":  # Claude Code's mid-conversation system turns
            out.append({"role": "system", "content": "\n\n".join(
                _text(b, f"messages[{i}].content[{j}]") for j, b in enumerate(blocks)
                if b.get("type") == "text")})
        elif message["role"] == "user":
            out += _user(i, blocks, names, tools)
        else:
            out += _assistant(f"messages[{i}]", blocks, names, tools)
    return tuple(out)


def anthropic_tool_choice(body: dict) -> tuple[str | dict, bool]:
    """(the chat layer's tool_choice, whether several calls may come in one answer)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not get_bool(choice, "disable_parallel_tool_use", False) if kind else True
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}, parallel
    raise bad_request("tool_choice must be {type: auto}, {type: any}, {type: none} or "
                      "{type: tool, name: ...}", "tool_choice")


def anthropic_think(body: dict) -> bool | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind in ("enabled", "adaptive"):
        return True
    raise bad_request("thinking must be {type: enabled, budget_tokens: N} or "
                      "{type: disabled}", "thinking")


def anthropic_format(body: dict) -> dict | None:
    """`output_config.format` ({type: json_schema, schema}) -> the chat layer's format."""
    config = body.get("output_config")
    spec = config.get("format") if isinstance(config, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" \
            or not isinstance(spec.get("schema"), dict):
        raise bad_request("output_config.format must be {type: json_schema, schema: {...}}",
                          "output_config")
    return spec["schema"]


@dataclass
class Asked:
    """A /v1/messages request, translated."""
    entry: ModelEntry
    custom: Customization
    chat: ChatRequest
    parallel: bool  # whether several tool calls may come in one answer
    tools: Tools


async def chat_request(request: web.Request, body: dict, count_only: bool = False) -> Asked:
    entry, custom = await local_model(request, body, "/v1/messages")
    if not count_only and body.get("max_tokens") is None:
        raise bad_request("missing required field 'max_tokens'", "max_tokens")
    answer_limit(body, "max_tokens")
    sampling, load = body_options(body, ANTHROPIC_NAMES, custom.parameters)
    tools = anthropic_tools(body)
    messages, images = message_images(anthropic_messages(body, tools))
    tool_choice, parallel = anthropic_tool_choice(body)
    think = anthropic_think(body)
    if think and not (await served_model(entry, custom)).style.thinking:
        think = None  # Claude Code asks every model to think: one that cannot just answers
    return Asked(entry, custom, ChatRequest(
        id=new_request_id(), model_name=entry.name.tagged, options=sampling, load=load,
        messages=messages, tools=tools.offered, tool_choice=tool_choice, think=think,
        format=anthropic_format(body), has_images=bool(images), images=images,
        workload_hint="/v1/messages"), parallel, tools)


# ---- answer --------------------------------------------------------------------------------
def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.arguments}


def stop_reason(done: Done, any_calls: bool, paused: bool = False) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if any_calls:
        return "tool_use", None
    if paused:  # the search limit: the client sends the turn back to go on
        return "pause_turn", None
    if done.done_reason == "length":
        return "max_tokens", None
    if done.stop_sequence:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def _start_usage(event) -> dict:
    """Usage for message_start: what the first event knows (the final figures come last)."""
    read = cached = 0
    if isinstance(event, Token):
        read = event.prompt_eval_count
        cached = event.context_used - event.eval_count - read
    elif isinstance(event, Progress):  # a long prompt is being read: its size is known
        read, cached = event.prompt_total - event.prompt_cached, event.prompt_cached
    return {"input_tokens": read, "output_tokens": 0, "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0}


@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    asked = await chat_request(request, body)
    writer = MessagesWriter(asked.entry.name.tagged, asked.parallel,
                            SearchRun(asked.chat, asked.tools, assistant_turns))
    return await respond(request, asked.chat, writer, entry=asked.entry, custom=asked.custom,
                         stream=get_bool(body, "stream", False))


class MessagesWriter(Writer):
    """Anthropic's answer: a `message` with content blocks, or its SSE events, the blocks
    opened, filled and closed in order. The content is kept as it goes (`search.blocks`): a
    tool search the server runs adds its two blocks, and the next generation reads them."""

    def __init__(self, model: str, parallel: bool, search: SearchRun):
        self.base = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message",
                     "role": "assistant", "model": model}
        self.parallel = parallel
        self.search = search
        self.blocks = search.blocks  # the answer's content so far
        self.index = -1
        self.open: str | None = None  # the kind of the block being written
        self.any_calls = False
        self.written: Part | None = None  # the Done part follow_up_stream wrote

    # -- whole
    def follow_up(self, parsed: Parsed, done: Done) -> ChatRequest | None:
        calls = kept_calls(parsed.tool_calls, self.parallel)
        if parsed.thinking:
            self.blocks.append({"type": "thinking", "thinking": parsed.thinking,
                                "signature": ""})
        if parsed.content.strip() or (parsed.content and not calls):
            self.blocks.append({"type": "text", "text": parsed.content})
        for call in calls:
            if self.search.is_search(call):
                self.blocks += self.search.run(call)
            else:
                self.blocks.append(tool_use_block(call))
                self.any_calls = self.search.client_calls = True
        return self.search.next_request(done)

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        reason, sequence = stop_reason(done, self.any_calls, self.search.paused)
        return {**self.base, "content": self.blocks, "stop_reason": reason,
                "stop_sequence": sequence, "usage": self.search.usage(done)}

    # -- streamed
    async def send(self, kind: str, data: dict) -> None:
        payload = json.dumps({"type": kind, **data})
        await self.write(f"event: {kind}\ndata: {payload}\n\n".encode())

    async def close_block(self) -> None:
        if self.open is not None:
            await self.send("content_block_stop", {"index": self.index})
            self.open = None

    async def open_block(self, kind: str, block: dict) -> None:
        await self.close_block()
        self.index += 1
        self.open = kind
        await self.send("content_block_start", {"index": self.index, "content_block": block})

    async def whole_block(self, block: dict, delta: dict | None = None) -> None:
        """A block sent at once (a tool call, a search's result), kept with the content."""
        self.blocks.append(block)
        start = {**block, "input": {}} if delta is not None else block
        await self.open_block(block["type"], start)
        if delta is not None:
            await self.send("content_block_delta", {"index": self.index, "delta": delta})
        await self.close_block()

    async def text(self, kind: str, text: str) -> None:
        """Text or thinking, appended to the open block of that kind (else a new one)."""
        if self.open != kind:
            block = ({"type": "text", "text": ""} if kind == "text" else
                     {"type": "thinking", "thinking": "", "signature": ""})
            await self.open_block(kind, block)
            self.blocks.append(dict(block))
        self.blocks[-1][kind] += text
        delta = ({"type": "text_delta", "text": text} if kind == "text" else
                 {"type": "thinking_delta", "thinking": text})
        await self.send("content_block_delta", {"index": self.index, "delta": delta})

    async def call(self, call: ToolCall) -> None:
        """A tool call: the client's as a tool_use block; a search, run here, as its
        server_tool_use block and its result."""
        if self.search.is_search(call):
            use, result = self.search.run(call)
            await self.whole_block(use, {"type": "input_json_delta",
                                         "partial_json": json.dumps(call.arguments)})
            await self.whole_block(result)
            return
        await self.whole_block(tool_use_block(call), {
            "type": "input_json_delta", "partial_json": json.dumps(call.arguments)})
        self.any_calls = self.search.client_calls = True

    async def start(self, first: Part) -> None:
        await self.send("message_start", {"message": {
            **self.base, "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": _start_usage(first.event)}})

    async def part(self, part: Part) -> None:
        parsed = part.parsed
        if isinstance(part.event, Progress):  # the prompt is being read
            await self.send("ping", {})
        if parsed.thinking:
            await self.text("thinking", parsed.thinking)
        if parsed.content:
            await self.text("text", parsed.content)
        for call in kept_calls(parsed.tool_calls, self.parallel):
            await self.call(call)

    async def follow_up_stream(self, part: Part) -> ChatRequest | None:
        await self.part(part)
        self.written = part
        await self.close_block()
        return self.search.next_request(part.event)

    async def done(self, part: Part) -> None:
        if part is not self.written:
            await self.part(part)
        await self.close_block()
        reason, sequence = stop_reason(part.event, self.any_calls, self.search.paused)
        await self.send("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": self.search.usage(part.event)})
        await self.send("message_stop", {})

    async def error(self, message: str) -> None:
        await self.send("error", {"error": {"type": "api_error", "message": message}})


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    asked = await chat_request(request, body, count_only=True)
    return web.json_response({"input_tokens": await count_prompt_tokens(
        request.app, asked.entry, asked.chat, asked.custom)})

