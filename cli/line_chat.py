"""`localllm run MODEL` with stdin not a terminal: a chat a line a turn, for pipes and scripts.

The slash commands are the chat screen's (tui/slash.py parses both), as `ollama run` has them;
those that need the screen (/chats, /regen, ...) say so.
"""

from __future__ import annotations

import sys

from localllm.client import Client, DaemonError
from localllm.tui.slash import Command, SlashError, help_text, parse, request_extra, show_text
from localllm.tui.stats import answer_notes

SCREEN_ONLY = ("chats", "save", "export", "regen", "stop")


class LineChat:
    def __init__(self, client: Client, model: str, options: dict, extra: dict, verbose: bool):
        self.client, self.model, self.options, self.extra = client, model, options, extra
        self.verbose = verbose
        self.system = ""
        self.format = ""
        self.think: bool | None = None
        self.history: list[dict] = []

    async def turn(self, text: str) -> None:
        from localllm.cli.run import _answer

        self.history.append({"role": "user", "content": text})
        messages = [{"role": "system", "content": self.system}] if self.system else []
        extra = {**self.extra, **request_extra(self.format, self.think)}
        final = await _answer(self.client, self.model, messages + self.history,
                              self.options or None, extra, self.verbose, guard=True)
        self.history.append({"role": "assistant", "content": final.get("text", "")})
        for note, _ in answer_notes(final, 0, False):  # (_answer said the loop and timings)
            print(f"note: {note}", file=sys.stderr)

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
        elif name == "set parameter":
            self.options[args[0]] = args[1]
        elif name == "unset parameter":
            self.options.pop(args[0], None)
        elif name == "set system":
            self.system = args[0]
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
        elif name == "help":
            print(help_text(*args), file=sys.stderr)
        elif name == "show":
            await self.show(command)
        return True

    async def show(self, command: Command) -> None:
        what = command.args[0]
        if what == "parameters":
            rows = [f"  {k:<18} {v}" for k, v in self.options.items()]
            print("\n".join(rows) or "No parameters set.")
        elif what == "system":
            print(self.system or "No system message.")
        elif what == "plan":
            print("Error: /show plan needs the chat screen; `localllm ps` shows the plan",
                  file=sys.stderr)
        else:
            try:
                data = await self.client.request("POST", "/api/show", {"model": self.model})
            except DaemonError as e:
                print(f"Error: {e}", file=sys.stderr)
                return
            print(show_text(what, data, self.model))


async def chat_lines(client: Client, model: str, options: dict, extra: dict,
                     verbose: bool) -> None:
    chat = LineChat(client, model, options, extra, verbose)
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not await chat.command(line):
                break
            continue
        await chat.turn(raw.rstrip("\n"))
