"""Anthropic's answer on /v1/messages: a `message` of content blocks, or its SSE events."""

from __future__ import annotations

import json
import uuid

from localllm.engine.runner.protocol import Done, Progress, Token

from ..chat.parse import Parsed, ToolCall
from ..chat.request import ChatRequest
from .anthropic_search import SearchRun
from .common import kept_calls
from .respond import Part, Writer


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
        self.stop: str | None = None  # a stop reason of the answer's own (a compaction's)
        self.edits: list[dict] | None = None  # the context edits applied, when asked for any

    def ending(self, done: Done) -> dict:
        """The answer's stop reason and sequence, and the context edits applied."""
        reason, sequence = stop_reason(done, self.any_calls, self.search.paused)
        managed = {} if self.edits is None else {"context_management": {
            "applied_edits": self.edits}}
        return {"stop_reason": self.stop or reason, "stop_sequence": sequence, **managed}

    # -- whole
    async def follow_up(self, parsed: Parsed, done: Done) -> ChatRequest | None:
        calls = kept_calls(parsed.tool_calls, self.parallel)
        if parsed.thinking:
            self.blocks.append({"type": "thinking", "thinking": parsed.thinking,
                                "signature": ""})
        if parsed.content.strip() or (parsed.content and not calls):
            self.blocks.append({"type": "text", "text": parsed.content})
        for call in calls:
            if self.search.is_search(call):
                self.blocks += await self.search.run(call)
            else:
                self.blocks.append(tool_use_block(call))
                self.any_calls = self.search.client_calls = True
        return self.search.next_request(done)

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        return {**self.base, "content": self.blocks, **self.ending(done),
                "usage": self.search.usage(done)}

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
            use, result = await self.search.run(call)
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
        ending = self.ending(part.event)
        managed = ending.pop("context_management", None)
        await self.send("message_delta", {
            "delta": ending, "usage": self.search.usage(part.event),
            **({"context_management": managed} if managed is not None else {})})
        await self.send("message_stop", {})

    async def error(self, message: str) -> None:
        await self.send("error", {"error": {"type": "api_error", "message": message}})
