"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as Claude Code speaks it.

A request becomes the one `ChatRequest`: `system` and the messages' blocks become HF-shaped
messages (tool_use -> an assistant's tool_calls, tool_result -> a tool message, thinking ->
reasoning_content), `tools` with `input_schema` become function tools, and the sampling fields go
through the option table. The answer is a `message` with content blocks, or Anthropic's SSE
events. `output_config.format` (a JSON schema) constrains the answer as `format` does.
Accepted and ignored: `metadata`, `cache_control`, `service_tier`, `output_config.effort`,
`container`, `speed` and the other fields the chat layer has no use for, a thinking block's
`signature`, `redacted_thinking` blocks, `thinking.budget_tokens`, and Anthropic's own server and
versioned tools (web_search_..., bash_..., text_editor_...), which are left out of the prompt, as
are tools with `defer_loading: true` (Claude Code's placeholder, never to be called).
"""

from __future__ import annotations

import json
import uuid

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


def _tool_result(block: dict, where: str, names: dict[str, str]) -> dict:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise bad_request(f"{where}.tool_use_id must be a string", "messages")
    content = block.get("content", "")
    texts, images = [], []
    for j, part in enumerate(_blocks(content, f"{where}.content")):
        if part.get("type") == "text":
            texts.append(_text(part, f"{where}.content[{j}]"))
        elif part.get("type") == "image":
            images.append(image_from_block(part, f"{where}.content[{j}]"))
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


def _user(i: int, blocks: list[dict], names: dict[str, str]) -> list[dict]:
    """A user turn: its tool results first (as tool messages), then its text and images."""
    results, texts, images = [], [], []
    for j, block in enumerate(blocks):
        where, kind = f"messages[{i}].content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "image":
            images.append(image_from_block(block, where))
        elif kind == "tool_result":
            results.append(_tool_result(block, where, names))
        else:
            raise bad_request(f"{where}: a user block of type {kind!r} is not supported "
                              f"(text, image and tool_result are)", "messages")
    if texts or images or not results:
        user: dict = {"role": "user", "content": "\n".join(texts)}
        if images:
            user["images"] = images
        results.append(user)
    return results


def _assistant(i: int, blocks: list[dict], names: dict[str, str]) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        where, kind = f"messages[{i}].content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "tool_use":
            name, use_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
            if not isinstance(name, str) or not isinstance(use_id, str):
                raise bad_request(f"{where} needs an id and a name", "messages")
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}.input must be an object", "messages")
            names[use_id] = name
            calls.append({"type": "function", "id": use_id,
                          "function": {"name": name, "arguments": arguments}})
        elif kind in ("redacted_thinking", "server_tool_use", "web_search_tool_result"):
            continue  # nothing this server can read or run
        else:
            raise bad_request(f"{where}: an assistant block of type {kind!r} is not supported "
                              f"(text, thinking and tool_use are)", "messages")
    out: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        out["tool_calls"] = calls
    if thinking:
        out["reasoning_content"] = out["thinking"] = "\n".join(thinking)
    return out


ROLES = ("user", "assistant", "system")


def anthropic_messages(body: dict) -> tuple[dict, ...]:
    """`system` and `messages` in the HF shape the chat layer renders (see get_messages). A
    system message among `messages` (Claude Code sends them) stays where it is: the chat layer
    places it as the model's template allows (chat/roles.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("field 'messages' must be a non-empty list of {role, content} "
                          "objects", "messages")
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
            out += _user(i, blocks, names)
        else:
            out.append(_assistant(i, blocks, names))
    return tuple(out)


def anthropic_tools(body: dict) -> tuple[dict, ...]:
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("field 'tools' must be a list of tool objects", "tools")
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in (None, "custom"):
            continue  # Anthropic's server and versioned tools: nothing here runs them
        if tool.get("defer_loading"):
            continue  # found through a tool search this server does not run: not offered
        name, schema = tool.get("name"), tool.get("input_schema", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name must be a string", "tools")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        out.append({"type": "function", "function": {
            "name": name, "description": str(tool.get("description") or ""),
            "parameters": schema}})
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


async def chat_request(request: web.Request, body: dict, count_only: bool = False
                       ) -> tuple[ModelEntry, Customization, ChatRequest, bool]:
    entry, custom = await local_model(request, body, "/v1/messages")
    if not count_only and body.get("max_tokens") is None:
        raise bad_request("missing required field 'max_tokens'", "max_tokens")
    answer_limit(body, "max_tokens")
    sampling, load = body_options(body, ANTHROPIC_NAMES, custom.parameters)
    messages, images = message_images(anthropic_messages(body))
    tool_choice, parallel = anthropic_tool_choice(body)
    think = anthropic_think(body)
    if think and not (await served_model(entry, custom)).style.thinking:
        think = None  # Claude Code asks every model to think: one that cannot just answers
    return entry, custom, ChatRequest(
        id=new_request_id(), model_name=entry.name.tagged, options=sampling, load=load,
        messages=messages, tools=anthropic_tools(body), tool_choice=tool_choice, think=think,
        format=anthropic_format(body), has_images=bool(images), images=images,
        workload_hint="/v1/messages"), parallel


# ---- answer --------------------------------------------------------------------------------
def tool_use_block(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.arguments}


def content_blocks(parsed: Parsed, parallel: bool) -> list[dict]:
    calls = kept_calls(parsed.tool_calls, parallel)
    blocks: list[dict] = []
    if parsed.thinking:
        blocks.append({"type": "thinking", "thinking": parsed.thinking, "signature": ""})
    if parsed.content.strip() or (parsed.content and not calls):
        blocks.append({"type": "text", "text": parsed.content})
    return blocks + [tool_use_block(call) for call in calls]


def stop_reason(done: Done, any_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if any_calls:
        return "tool_use", None
    if done.done_reason == "length":
        return "max_tokens", None
    if done.stop_sequence:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def usage(done: Done) -> dict:
    # input_tokens is the part of the prompt read afresh; the reused prefix is reported apart.
    return {"input_tokens": done.prompt_tokens - done.cached_tokens,
            "output_tokens": done.eval_count,
            "cache_read_input_tokens": done.cached_tokens, "cache_creation_input_tokens": 0}


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
    entry, custom, chat, parallel = await chat_request(request, body)
    return await respond(request, chat, MessagesWriter(entry.name.tagged, parallel),
                         entry=entry, custom=custom, stream=get_bool(body, "stream", False))


class MessagesWriter(Writer):
    """Anthropic's answer: a `message` with content blocks, or its SSE events, the blocks
    opened, filled and closed in order."""

    def __init__(self, model: str, parallel: bool):
        self.base = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message",
                     "role": "assistant", "model": model}
        self.parallel = parallel
        self.index = -1
        self.open: str | None = None  # the kind of the block being written
        self.any_calls = False

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        reason, sequence = stop_reason(done, bool(parsed.tool_calls))
        return {**self.base, "content": content_blocks(parsed, self.parallel),
                "stop_reason": reason, "stop_sequence": sequence, "usage": usage(done)}

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

    async def text(self, kind: str, text: str) -> None:
        """Text or thinking, appended to the open block of that kind (else a new one)."""
        if self.open != kind:
            await self.open_block(kind, {"type": "text", "text": ""} if kind == "text" else
                                  {"type": "thinking", "thinking": "", "signature": ""})
        delta = ({"type": "text_delta", "text": text} if kind == "text" else
                 {"type": "thinking_delta", "thinking": text})
        await self.send("content_block_delta", {"index": self.index, "delta": delta})

    async def tool_use(self, call: ToolCall) -> None:
        await self.open_block("tool_use", {**tool_use_block(call), "input": {}})
        await self.send("content_block_delta", {"index": self.index, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(call.arguments)}})
        await self.close_block()

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
            await self.tool_use(call)
            self.any_calls = True

    async def done(self, part: Part) -> None:
        await self.part(part)
        await self.close_block()
        reason, sequence = stop_reason(part.event, self.any_calls)
        await self.send("message_delta", {
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(part.event)})
        await self.send("message_stop", {})

    async def error(self, message: str) -> None:
        await self.send("error", {"error": {"type": "api_error", "message": message}})


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    entry, custom, chat, _ = await chat_request(request, body, count_only=True)
    return web.json_response({"input_tokens": await count_prompt_tokens(
        request.app, entry, chat, custom)})

