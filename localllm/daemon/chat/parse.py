"""Model output -> content, thinking and tool calls, as it streams.

`feed(text)` returns what can be shown now; text that might be the start of a marker is held
back until the next piece decides it. `finish()` flushes the rest. Formats, as models write them:
- think tags: `<think>reasoning</think>answer` (the prompt may already end in `<think>`);
- Hermes/Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one per call;
- Llama 3.x: the answer is the call, `{"name": ..., "parameters": {...}}`, maybe after
  `<|python_tag|>`;
- Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}]` or `[TOOL_CALLS]name[ARGS]{...}`;
- gpt-oss (harmony): `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>
  commentary to=functions.name <|constrain|>json<|message|>{...}` and `<|channel|>final...`.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field

from .template import HARMONY, HERMES, JSON_CALLS, LLAMA3, MISTRAL, THINK_TAGS


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str
    index: int


@dataclass
class Parsed:
    content: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.thinking or self.tool_calls)

    def add(self, other: Parsed) -> None:
        self.content += other.content
        self.thinking += other.thinking
        self.tool_calls += other.tool_calls


def call_id() -> str:
    return "call_" + "".join(secrets.choice(string.ascii_lowercase + string.digits)
                             for _ in range(8))


def _split(buffer: str, markers: list[str]) -> tuple[str, str | None, str]:
    """(text before the first marker, the marker, text after); with no marker yet: (the text
    that cannot start one, None, the tail that might)."""
    best = None
    for marker in markers:
        at = buffer.find(marker)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, marker)
    if best is not None:
        at, marker = best
        return buffer[:at], marker, buffer[at + len(marker):]
    keep = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buffer)), 0, -1):
            if buffer.endswith(marker[:n]):
                keep = max(keep, n)
                break
    return buffer[:len(buffer) - keep], None, buffer[len(buffer) - keep:]


def _arguments(value) -> dict | None:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def calls_from_json(text: str) -> list[tuple[str, dict]] | None:
    """Every call in `text`: JSON objects (or arrays of them) with a name and arguments or
    parameters, separated by whitespace, commas or semicolons. None when anything else is
    there."""
    decoder = json.JSONDecoder()
    calls: list[tuple[str, dict]] = []
    i = 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i == len(text):
            return calls or None
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            args = _arguments(item.get("arguments", item.get("parameters", {})))
            if args is None:
                return None
            calls.append((item["name"], args))


class OutputParser:
    """Splits one answer. `tool_format` is None when the request has no tools: then nothing
    is read as a call. `thinking` is the template's thinking format; `in_thinking` says the
    prompt already opened the thinking block; `keep_thinking` False drops it (think: false)."""

    def __init__(self, tool_format: str | None = None, thinking: str | None = None,
                 in_thinking: bool = False, keep_thinking: bool = True):
        self.tool_format = tool_format
        self.think_tags = thinking == THINK_TAGS
        self.keep_thinking = keep_thinking
        self.mode = "thinking" if in_thinking and self.think_tags else "content"
        self.buffer = ""
        self.started = False  # any non-space content seen (Llama 3 calls must come first)
        self.after_think = False  # the blank lines after </think> are not the answer
        self.calls = 0

    # ---- public --------------------------------------------------------------------------
    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            step = self._step(final=False)
            if step is None:
                return out
            out.add(step)

    def finish(self) -> Parsed:
        out = Parsed()
        while (step := self._step(final=True)) is not None:
            out.add(step)
        return out

    # ---- modes ---------------------------------------------------------------------------
    def _content_markers(self) -> list[str]:
        markers = ["<think>"] if self.think_tags else []
        if self.tool_format == HERMES:
            markers.append("<tool_call>")
        elif self.tool_format == MISTRAL:
            markers.append("[TOOL_CALLS]")
        elif self.tool_format == LLAMA3:
            markers.append("<|python_tag|>")
        return markers

    def _step(self, final: bool) -> Parsed | None:
        """One move of the state machine; None when it needs more text (or, final, is done)."""
        if not self.buffer:
            return None
        if self.mode == "thinking":
            before, marker, after = _split(self.buffer, ["</think>"])
            if marker is None and final:
                before, after = self.buffer, ""
            self.buffer = after
            if marker:
                self.mode = "content"
                self.after_think = True
            if not before and marker is None:
                return None
            return Parsed(thinking=before if self.keep_thinking else "")
        if self.mode == "tool":  # Hermes: inside <tool_call>...</tool_call>
            before, marker, after = _split(self.buffer, ["</tool_call>"])
            if marker is None and not final:
                return None
            self.buffer = after if marker else ""
            self.mode = "content"
            return self._calls_or_text(before, "<tool_call>" + before + (marker or ""))
        if self.mode == "tail":  # Llama 3 / Mistral: the rest of the answer is the call(s)
            if not final:
                return None
            text, self.buffer = self.buffer, ""
            return self._tail_calls(text)
        return self._content(final)

    def _content(self, final: bool) -> Parsed | None:
        if self.after_think:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return None
            self.after_think = False
        if (not self.started and self.tool_format in (LLAMA3, JSON_CALLS)):
            stripped = self.buffer.lstrip()
            if not stripped:
                if final:
                    text, self.buffer = self.buffer, ""
                    return Parsed(content=text)
                return None
            self.started = True
            if stripped[0] in "{[":
                self.buffer = stripped
                self.mode = "tail"
                self.tail_marker = ""
                return Parsed()
        markers = self._content_markers()
        before, marker, after = _split(self.buffer, markers)
        if marker is None and final:
            before, after = self.buffer, ""
        self.buffer = after
        if before.strip():
            self.started = True
        if marker == "<think>":
            self.mode = "thinking"
        elif marker == "<tool_call>":
            self.mode = "tool"
        elif marker is not None:
            self.mode = "tail"
            self.tail_marker = marker
        if not before and marker is None:
            return None
        return Parsed(content=before)

    def _calls_or_text(self, body: str, original: str) -> Parsed:
        calls = calls_from_json(body.strip())
        if calls is None:
            return Parsed(content=original)  # not a call after all: show what the model wrote
        return Parsed(tool_calls=[self._call(name, args) for name, args in calls])

    def _tail_calls(self, text: str) -> Parsed:
        marker = getattr(self, "tail_marker", "")
        if self.tool_format == MISTRAL and "[ARGS]" in text:
            calls = []
            for part in text.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                parsed = _arguments(args.strip())
                if not name.strip() or parsed is None:
                    return Parsed(content=marker + text)
                calls.append(self._call(name.strip(), parsed))
            return Parsed(tool_calls=calls)
        result = self._calls_or_text(text.replace("[TOOL_CALLS]", ""), marker + text)
        return result

    def _call(self, name: str, arguments: dict) -> ToolCall:
        call = ToolCall(name=name, arguments=arguments, id=call_id(), index=self.calls)
        self.calls += 1
        return call


_HEADER_RECIPIENT = re.compile(r"to=(?:functions\.)?([^\s<]+)")


class HarmonyParser:
    """gpt-oss's channels: analysis is thinking, final is the answer, commentary addressed
    `to=functions.X` is a call of X, other commentary is shown as content."""

    def __init__(self, keep_thinking: bool = True, tools: bool = True):
        self.keep_thinking = keep_thinking
        self.tools = tools
        self.mode = "header"
        self.header = ""
        self.buffer = ""
        self.body_kind = "content"
        self.recipient = ""
        self.calls = 0

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while (step := self._step(final=False)) is not None:
            out.add(step)
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        while (step := self._step(final=True)) is not None:
            out.add(step)
        return out

    def _step(self, final: bool) -> Parsed | None:
        if not self.buffer:
            return None
        if self.mode == "header":
            before, marker, after = _split(self.buffer, ["<|message|>"])
            if marker is None:
                if final:  # no channel at all: a plain answer
                    text, self.buffer = self.header + self.buffer, ""
                    return Parsed(content=text.replace("<|start|>assistant", ""))
                self.header += before
                self.buffer = after
                return None
            header = self.header + before
            self.header, self.buffer = "", after
            self.mode = "body"
            recipient = _HEADER_RECIPIENT.search(header)
            channel = re.search(r"<\|channel\|>(\w+)", header)
            name = channel.group(1) if channel else "final"
            if recipient and self.tools:
                self.body_kind, self.recipient = "call", recipient.group(1)
            elif name == "analysis":
                self.body_kind = "thinking"
            else:
                self.body_kind = "content"
            return Parsed()
        ends = ["<|end|>", "<|call|>", "<|return|>", "<|start|>"]
        if self.body_kind == "call":
            before, marker, after = _split(self.buffer, ends)
            if marker is None and not final:
                return None
            self.buffer = after if marker else ""
            self.mode = "header"
            args = _arguments(before.strip())
            if args is None:
                return Parsed(content=before)
            call = ToolCall(self.recipient, args, call_id(), self.calls)
            self.calls += 1
            return Parsed(tool_calls=[call])
        before, marker, after = _split(self.buffer, ends)
        if marker is None and final:
            before, after = self.buffer, ""
        self.buffer = after
        if marker is not None:
            self.mode = "header"
        if not before and marker is None:
            return None
        if self.body_kind == "thinking":
            return Parsed(thinking=before if self.keep_thinking else "")
        return Parsed(content=before)


def make_parser(tool_format: str | None, thinking: str | None, *, tools: bool,
                in_thinking: bool = False, keep_thinking: bool = True):
    if tool_format == HARMONY or thinking == "channels":
        return HarmonyParser(keep_thinking=keep_thinking, tools=tools)
    return OutputParser(tool_format if tools else None, thinking, in_thinking, keep_thinking)
