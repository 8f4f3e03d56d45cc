"""`localllm run MODEL` with stdin not a terminal: a chat a line a turn, for pipes and scripts.

The slash commands are the chat screen's (tui/slash.py parses both), as `ollama run` has them;
those that need the screen (/chats, /regen, ...) say so.
"""

from __future__ import annotations

import itertools
import shutil
import sys

from localllm.client import Client, DaemonError
from localllm.tui.slash import (
    NO_TEMPLATE,
    Command,
    SlashError,
    base_model_text,
    help_text,
    parse,
    request_extra,
    show_text,
)
from localllm.repeats import LoopGuard
from localllm.tui.stats import answer_notes, format_timings

SCREEN_ONLY = ("chats", "save", "export", "regen", "stop")
QUOTES = '"""'  # begins and ends a multi-line message


def cancelled_text(model: str) -> str:
    return (f"the answer was cancelled: {model} was unloaded while it answered (`localllm "
            "stop`, `rm` or a keep_alive of 0); what came before the cut is above")


class LineChat:
    def __init__(self, client: Client, model: str, options: dict, extra: dict, verbose: bool):
        self.client, self.model, self.options, self.extra = client, model, options, extra
        self.verbose = verbose
        self.system = ""
        self.format = ""
        self.think: bool | None = None
        self.history: list[dict] = []
        self.cancelled = False  # an answer was cut by `localllm stop`: the exit status says so

    async def turn(self, text: str) -> None:
        self.history.append({"role": "user", "content": text})
        messages = [{"role": "system", "content": self.system}] if self.system else []
        extra = {**self.extra, **request_extra(self.format, self.think)}
        final = await stream_answer(self.client, self.model, messages + self.history,
                                    self.options or None, extra, self.verbose, guard=True)
        self.history.append({"role": "assistant", "content": final.get("text", "")})
        if final.get("done_reason") == "cancelled":
            self.cancelled = True
            print(f"Error: {cancelled_text(self.model)}", file=sys.stderr)
        # (stream_answer said the loop and the timings)
        for note, _ in answer_notes(final, 0, False):
            print(f"note: {note}", file=sys.stderr)

    async def turn_if_any(self, text: str) -> None:
        if text.strip():
            await self.turn(text.strip("\n"))

    async def command(self, line: str) -> bool:
        """Run a slash command; False when it ends the chat."""
        try:
            command = parse(line)
        except SlashError as e:
            print(f"Error: {e}", file=sys.stderr)
            return True
        name, args = command.name, command.args
        if name == "bye":
            return False
        if name in SCREEN_ONLY:
            print(f"Error: /{name} needs the chat screen (run in a terminal)", file=sys.stderr)
        elif name == "set parameter":  # said on stderr as `ollama run` says it, stdout answers
            self.options[args[0]] = args[1]
            shown = " ".join(args[1]) if isinstance(args[1], list) else args[1]
            print(f"Set parameter '{args[0]}' to '{shown}'", file=sys.stderr)
        elif name == "unset parameter":
            self.options.pop(args[0], None)
            print(f"Parameter '{args[0]}' is back to its default", file=sys.stderr)
        elif name == "set system":
            self.system = args[0]
            print("Set system message." if self.system else "Cleared the system message.",
                  file=sys.stderr)
        elif name == "set verbose":
            self.verbose = args[0]
        elif name == "set format":
            self.format = args[0]
        elif name == "set think":
            self.think = args[0]
        elif name == "clear":
            self.history.clear()
        elif name == "load":
            self.model = args[0]
            await self.note_base_model()
        elif name == "help":
            print(help_text(*args), file=sys.stderr)
        elif name == "show":
            await self.show(command)
        return True

    async def note_base_model(self) -> None:
        """A model without a chat template continues text: say so when it is loaded."""
        try:
            data = await self.client.request("POST", "/api/show", {"model": self.model})
        except DaemonError:
            return  # the next message says what is wrong with the name
        if data.get("template", "") in NO_TEMPLATE:
            print(base_model_text(self.model), file=sys.stderr)

    async def show(self, command: Command) -> None:
        what = command.args[0]
        if what == "plan":
            print("Error: /show plan needs the chat screen; `localllm ps` shows the plan",
                  file=sys.stderr)
        else:
            try:
                data = await self.client.request("POST", "/api/show", {"model": self.model})
            except DaemonError as e:
                if what not in ("parameters", "system"):  # those the chat has set, at least
                    print(f"Error: {e}", file=sys.stderr)
                    return
                data = {}
            print(show_text(what, data, self.model, self.options, self.system))


async def chat_lines(client: Client, model: str, options: dict, extra: dict,
                     verbose: bool, first: list[str] = ()) -> int:
    """A turn a line, after the lines `run` read to tell a script from a prompt (`first`); a
    block between triple-quote lines is one message, as the chat's /? says."""
    chat = LineChat(client, model, options, extra, verbose)
    block: list[str] | None = None
    for raw in itertools.chain(first, sys.stdin):
        line = raw.rstrip("\n")
        if block is not None:  # inside a block: up to the line that ends with the quotes
            end = line.rstrip().endswith(QUOTES)
            block.append(line.rstrip()[:-len(QUOTES)] if end else line)
            if end:
                await chat.turn_if_any("\n".join(block))
                block = None
            continue
        stripped = line.strip()
        if stripped.startswith(QUOTES):
            rest = stripped[len(QUOTES):]
            if len(rest) >= len(QUOTES) and rest.endswith(QUOTES):  # """one line"""
                await chat.turn_if_any(rest[:-len(QUOTES)])
            else:
                block = [rest]
            continue
        if not stripped:
            continue
        if stripped.startswith("/"):
            if not await chat.command(stripped):
                break
            continue
        await chat.turn(line)
    else:
        if block is not None:  # stdin ended inside a block: what was written is the message
            await chat.turn_if_any("\n".join(block))
    return 1 if chat.cancelled else 0


async def stream_answer(client: Client, model: str, messages: list[dict], options, extra,
                        verbose: bool, guard: bool = False, raw: bool = False,
                        show_thinking: bool = False, wrap: bool = False) -> dict:
    """Stream one answer to stdout; the last line's data, with the whole text as `text`.
    With `guard`, an answer caught in a loop is cut off (closing the stream stops the model).
    With `raw`, the one message's text goes to /api/generate as it is (extra says raw).
    `show_thinking`: a thinking model's thinking first, as `ollama run --think` shows it;
    `wrap`: words wrapped at the terminal's edge, never split (`ollama run`'s default)."""
    parts = []
    loops = LoopGuard()
    final: dict = {}
    looping = 0
    thinking = False
    out = WordWrap(shutil.get_terminal_size().columns) if wrap else None
    stream = client.generate(model, messages[-1]["content"], options, **extra) if raw else \
        client.chat(model, messages, options, **extra)
    async for chunk in stream:
        thought = (chunk.data.get("message") or {}).get("thinking") or \
            chunk.data.get("thinking") or ""
        if show_thinking and thought:
            if not thinking:
                sys.stdout.write("Thinking...\n")
                thinking = True
            sys.stdout.write(out.feed(thought) if out else thought)
            sys.stdout.flush()
        if chunk.text:
            if thinking:
                sys.stdout.write((out.flush() if out else "") + "\n...done thinking.\n\n")
                thinking = False
            parts.append(chunk.text)
            sys.stdout.write(out.feed(chunk.text) if out else chunk.text)
            sys.stdout.flush()
        if chunk.done:
            final = chunk.data
            looping = loops.ended(final) if guard else 0
        elif guard and (looping := loops.feed(chunk.text)):
            break
    sys.stdout.write((out.flush() if out else "") + "\n")
    sys.stdout.flush()
    if looping:
        print(f"note: {LoopGuard.note(looping)}", file=sys.stderr)
    if verbose and final:
        print(format_timings(final), file=sys.stderr)
    return {**final, "text": "".join(parts)}


class WordWrap:
    """Streamed text wrapped at `width` columns between words, never inside one: a word is
    held until the space after it shows it whole (`ollama run` wraps so by default)."""

    def __init__(self, width: int):
        self.width = max(20, width)
        self.column = 0
        self.word = ""

    def feed(self, text: str) -> str:
        out = []
        for ch in text:
            if ch == "\n":
                out.append(self._word() + "\n")
                self.column = 0
            elif ch == " ":
                out.append(self._word())
                if self.column < self.width:
                    out.append(" ")
                    self.column += 1
            else:
                self.word += ch
        return "".join(out)

    def flush(self) -> str:
        return self._word()

    def _word(self) -> str:
        word, self.word = self.word, ""
        if not word:
            return ""
        if self.column and self.column + len(word) > self.width:
            self.column = len(word)
            return "\n" + word
        self.column += len(word)
        return word

