"""Context management on /v1/messages: the `context_management.edits` Anthropic's API applies
before the model reads the prompt, applied here the same way.

- `clear_tool_uses_20250919`: once the prompt reaches `trigger` input tokens (100,000 unless
  given), the results of all but the last `keep` tool uses (3 unless given; `exclude_tools`
  never) are replaced by a placeholder, their calls' inputs too with `clear_tool_inputs`, and
  only when that clears `clear_at_least` tokens. The client keeps its full history; the
  answer's `context_management.applied_edits` says what was cleared, in tokens counted by the
  model's tokenizer. The prompt before the first cleared result is unchanged (its cache holds);
  on the next turns only the newest cleared result moves.
- `compact_20260112`: once the prompt reaches `trigger` tokens (150,000 unless given; any
  value is taken, local contexts being small), the model first summarises the conversation
  on the prompt it has cached (chat/compaction.py: the instruction, or the edit's
  `instructions`, appended as a user turn: the transcript is not read again), the answer
  opens with a `compaction` block holding the summary, and the model then answers from the
  summary alone, or stops there (`pause_after_compaction`, stop_reason `compaction`). The
  client sends the block back; everything before it is left out from then on.
- `clear_thinking_20251015` is accepted: the chat templates decide which earlier thinking the
  prompt shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from aiohttp import web
from localllm.engine.runner.protocol import Done
from localllm.modelstore.store import ModelEntry

from ..chat.compaction import summarising, summary_message, summary_text
from localllm.modelstore.custom import Customization
from ..chat.parse import Parsed
from ..chat.request import ChatRequest
from localllm.engine.runner.protocol import new_request_id
from .anthropic_writer import MessagesWriter
from .common import bad_request
from .respond import Part, count_prompt_tokens

CLEAR_TOOL_USES, CLEAR_THINKING, COMPACT = ("clear_tool_uses_20250919",
                                            "clear_thinking_20251015", "compact_20260112")
CLEARED = "[This tool result was cleared to save context; run the tool again if it is needed.]"


@dataclass(frozen=True)
class Edits:
    clear: dict | None = None  # the clear_tool_uses edit, when asked for
    compact: dict | None = None  # the compact edit, when asked for

    def __bool__(self) -> bool:
        return self.clear is not None or self.compact is not None


def context_edits(body: dict) -> Edits | None:
    """`context_management.edits`, checked (None when the request has none)."""
    managed = body.get("context_management")
    if managed is None:
        return None
    edits = managed.get("edits") if isinstance(managed, dict) else None
    if not isinstance(edits, list) or not all(isinstance(e, dict) for e in edits):
        raise bad_request("context_management must be {edits: [{type: ...}, ...]}",
                          "context_management")
    unknown = [e.get("type") for e in edits
               if e.get("type") not in (CLEAR_TOOL_USES, CLEAR_THINKING, COMPACT)]
    if unknown:  # a type may be any JSON value: shown, never hashed
        raise bad_request(f"context_management.edits: unknown type "
                          f"{json.dumps(unknown)[:200]} ({CLEAR_TOOL_USES}, {CLEAR_THINKING} "
                          f"and {COMPACT} are known)", "context_management")
    kinds = {e["type"]: e for e in edits}
    for edit in kinds.values():
        _check_edit(edit)
    return Edits(kinds.get(CLEAR_TOOL_USES), kinds.get(COMPACT))


def _check_edit(edit: dict) -> None:
    """Every field an edit is read by, checked when the request comes (a 400 then, never a
    surprise where the edit triggers)."""
    kind = edit["type"]
    if kind == CLEAR_TOOL_USES:
        _value(edit, "trigger", "input_tokens", 0)
        _value(edit, "keep", "tool_uses", 0)
        _value(edit, "clear_at_least", "input_tokens", 0)
        exclude = edit.get("exclude_tools")
        if exclude is not None and not (isinstance(exclude, list)
                                        and all(isinstance(n, str) for n in exclude)):
            raise bad_request(f"context_management: {kind}.exclude_tools must be a list of "
                              f"tool names", "context_management")
    elif kind == COMPACT:
        _value(edit, "trigger", "input_tokens", 0)
        if not isinstance(edit.get("instructions") or "", str):
            raise bad_request(f"context_management: {kind}.instructions must be text",
                              "context_management")


def _value(edit: dict, key: str, kind: str, default: int) -> int:
    """An edit's {type: kind, value: N} field (`trigger`, `keep`, `clear_at_least`)."""
    field = edit.get(key)
    if field is None:
        return default
    value = field.get("value") if isinstance(field, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 \
            or field.get("type", kind) != kind:
        raise bad_request(f"context_management: {edit['type']}.{key} must be "
                          f"{{type: {kind}, value: N}}", "context_management")
    return value


def cleared(messages: tuple[dict, ...], edit: dict, keep_names: set[str]
            ) -> tuple[tuple[dict, ...], int]:
    """`messages` with all but the last `keep` tool results cleared (not those of
    `exclude_tools` nor of `keep_names`), and how many were."""
    keep = _value(edit, "keep", "tool_uses", 3)
    exclude = set(edit.get("exclude_tools") or ()) | keep_names
    results = [i for i, m in enumerate(messages)
               if m["role"] == "tool" and m.get("name") not in exclude]
    chosen = results[:len(results) - keep] if keep else results
    out = list(messages)
    for i in chosen:
        out[i] = {k: v for k, v in out[i].items() if k != "images"} | {"content": CLEARED}
    if edit.get("clear_tool_inputs"):
        ids = {messages[i].get("tool_call_id") for i in chosen}
        for i, m in enumerate(out):
            if m.get("tool_calls"):
                out[i] = {**m, "tool_calls": [
                    {**c, "function": {**c["function"], "arguments": {}}} if c.get("id") in ids
                    else c for c in m["tool_calls"]]}
    return tuple(out), len(chosen)


async def managed(app: web.Application, entry: ModelEntry, custom: Customization,
                  chat: ChatRequest, edits: Edits, writer: MessagesWriter,
                  search_names: set[str]) -> tuple[ChatRequest, MessagesWriter]:
    """The request with the edits that trigger applied, and the writer of its answer."""
    applied: list[dict] = []
    tokens = await count_prompt_tokens(app, entry, chat, custom)
    if edits.clear is not None and tokens >= _value(edits.clear, "trigger", "input_tokens",
                                                    100_000):
        messages, count = cleared(chat.messages, edits.clear, search_names)
        if count:
            after = await count_prompt_tokens(app, entry, replace(chat, messages=messages),
                                              custom)
            if tokens - after >= _value(edits.clear, "clear_at_least", "input_tokens", 0):
                applied.append({"type": CLEAR_TOOL_USES, "cleared_tool_uses": count,
                                "cleared_input_tokens": tokens - after})
                chat, tokens = replace(chat, messages=messages), after
    writer.edits = applied
    if edits.compact is not None and tokens >= _value(edits.compact, "trigger",
                                                      "input_tokens", 150_000):
        writer = CompactingWriter(writer, chat, edits.compact)
        chat = summarising(chat, edits.compact.get("instructions"))
    return chat, writer


class CompactingWriter(MessagesWriter):
    """The answer when a compaction triggers: its first generation is the summary (kept whole,
    never streamed as text), which becomes the `compaction` block; the next generation, unless
    the client asked to pause, answers from the summary alone."""

    def __init__(self, plain: MessagesWriter, chat: ChatRequest, edit: dict):
        super().__init__(plain.base["model"], plain.parallel, plain.search)
        self.edits = plain.edits
        self.chat, self.edit = chat, edit
        self.summarising = True
        self.summary = Parsed()

    def compacted(self, parsed: Parsed, done: Done) -> tuple[dict, ChatRequest | None]:
        """The summary's block, and the request that answers from it (None: pause)."""
        self.summarising = False
        text = summary_text(parsed.content, parsed.thinking)
        block = {"type": "compaction", "content": text}
        if self.edit.get("pause_after_compaction"):
            self.stop = "compaction"
            return block, None
        self.search.earlier.append(done)  # the usage counts the summarising turn too
        system = [m for m in self.chat.messages[:1] if m["role"] == "system"]
        chat = replace(self.chat, id=new_request_id(),
                       messages=(*system, summary_message(text)))
        self.search.chat = chat  # a search after this builds on the compacted conversation
        return block, chat

    async def follow_up(self, parsed: Parsed, done: Done) -> ChatRequest | None:
        if not self.summarising:
            return await super().follow_up(parsed, done)
        block, chat = self.compacted(parsed, done)
        self.blocks.append(block)
        return chat

    async def part(self, part: Part) -> None:
        if self.summarising:
            self.summary.add(part.parsed)
        else:
            await super().part(part)

    async def follow_up_stream(self, part: Part) -> ChatRequest | None:
        if not self.summarising:
            return await super().follow_up_stream(part)
        self.summary.add(part.parsed)
        self.written = part
        block, chat = self.compacted(self.summary, part.event)
        await self.whole_block(block)
        return chat
