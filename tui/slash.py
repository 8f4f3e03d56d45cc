"""Slash commands, as `ollama run` has them: parsing, parameter checks, completion and help.

Pure functions of the typed line; the app carries the parsed `Command` out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from localllm.daemon.runner.protocol import SPECULATIVE_CHOICES


class SlashError(ValueError):
    """A line the user typed that is not a valid command; the message says what is."""


@dataclass(frozen=True)
class Param:
    kind: type  # int, float or str
    low: float | None = None
    high: float | None = None
    help: str = ""


# The Ollama options the daemon reads (daemon/api/ollama.py parse_options), with its bounds.
PARAMETERS: dict[str, Param] = {
    "temperature": Param(float, 0, 100, "randomness; 0 always picks the likeliest token"),
    "top_k": Param(int, 0, None, "sample from the k likeliest tokens"),
    "top_p": Param(float, 0, 1, "sample from the smallest set with this much probability"),
    "min_p": Param(float, 0, 1, "drop tokens below this share of the likeliest one"),
    "typical_p": Param(float, 0, 1, "locally typical sampling"),
    "repeat_penalty": Param(float, 0, None, "penalise repeating recent tokens"),
    "repeat_last_n": Param(int, -1, None, "how far back repeat_penalty looks (-1: context)"),
    "presence_penalty": Param(float, None, None, "penalise tokens already present"),
    "frequency_penalty": Param(float, None, None, "penalise tokens by how often they appeared"),
    "seed": Param(int, None, None, "random seed, for repeatable answers"),
    "num_predict": Param(int, -2, None, "most tokens per answer (-1: until the model stops)"),
    "stop": Param(str, help="stop strings (several allowed)"),
    "num_ctx": Param(int, 256, 1 << 24, "context length; reloads the model"),
    "num_gpu": Param(int, -1, None, "layers on the GPU; reloads the model"),
    "num_thread": Param(int, -1, None, "CPU threads; reloads the model"),
    "num_batch": Param(int, -1, None, "prompt batch size; reloads the model"),
    "speculative": Param(str, help="drafting: auto, off, lookup, mtp or draft (mtp and draft "
                         "reload the model)"),
    "draft_model": Param(str, help="the model that drafts for speculative draft; reloads"),
}

SHOW_WHAT = ("info", "parameters", "system", "template", "plan")

# (usage, what it does), in the order /? lists them.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("/set parameter NAME VALUE", "set a sampling or load option for the next answers"),
    ("/set system TEXT", "set the system message"),
    ("/unset parameter NAME", "go back to the default for an option"),
    ("/show info|parameters|system|template|plan", "show the model, the options or the plan"),
    ("/load MODEL", "chat with another model (the conversation is kept)"),
    ("/save NAME", "name this chat, to reopen it with `localllm run --resume NAME`"),
    ("/chats", "list saved chats and open one"),
    ("/export [FILE]", "write this chat as Markdown"),
    ("/clear", "start a new chat (this one stays saved)"),
    ("/regen", "answer the last prompt again"),
    ("/stop", "stop the answer in progress"),
    ("/bye", "quit"),
    ("/?", "this help; `/? keys` lists the keys"),
)


@dataclass(frozen=True)
class Command:
    name: str  # "set parameter", "set system", "unset parameter", "show", "load", "save", ...
    args: tuple = ()


def parse(line: str) -> Command:
    """A typed slash command line -> Command; SlashError says what is wrong."""
    words = line.strip().split()
    if not words or not words[0].startswith("/"):
        raise SlashError("not a command")
    head, rest = words[0].lower(), words[1:]
    text_after = lambda n: line.strip().split(None, n)[n] if len(words) > n else ""
    if head in ("/?", "/help"):
        return Command("help", tuple(rest[:1]))
    if head in ("/bye", "/exit", "/quit"):
        return Command("bye")
    if head in ("/clear", "/new"):
        return Command("clear")
    if head == "/regen":
        return Command("regen")
    if head == "/stop":
        return Command("stop")
    if head == "/chats":
        return Command("chats")
    if head == "/export":
        return Command("export", (text_after(1),) if rest else ())
    if head == "/load":
        if len(rest) != 1:
            raise SlashError("usage: /load MODEL")
        return Command("load", (rest[0],))
    if head == "/save":
        if not rest:
            raise SlashError("usage: /save NAME")
        return Command("save", (text_after(1),))
    if head == "/show":
        if len(rest) != 1 or rest[0].lower() not in SHOW_WHAT:
            raise SlashError(f"usage: /show {'|'.join(SHOW_WHAT)}")
        return Command("show", (rest[0].lower(),))
    if head == "/set":
        if rest[:1] == ["system"]:
            return Command("set system", (text_after(2),))
        if rest[:1] == ["parameter"]:
            if len(rest) == 1:
                return Command("help", ("parameters",))
            if len(rest) < 3:
                raise SlashError("usage: /set parameter NAME VALUE")
            name, value = parse_parameter(rest[1], rest[2:])
            return Command("set parameter", (name, value))
        raise SlashError("usage: /set parameter NAME VALUE, or /set system TEXT")
    if head == "/unset":
        if len(rest) == 2 and rest[0] == "parameter":
            if rest[1] not in PARAMETERS:
                raise SlashError(unknown_parameter(rest[1]))
            return Command("unset parameter", (rest[1],))
        raise SlashError("usage: /unset parameter NAME")
    raise SlashError(f"unknown command '{words[0]}'; /? lists the commands")


def unknown_parameter(name: str) -> str:
    close = [p for p in PARAMETERS if p.startswith(name[:3])] or list(PARAMETERS)
    return f"unknown parameter '{name}'; try {', '.join(close)}"


def parse_parameter(name: str, values: list[str]) -> tuple[str, object]:
    """A parameter's text value(s) -> its typed value, checked against the daemon's bounds."""
    param = PARAMETERS.get(name)
    if param is None:
        raise SlashError(unknown_parameter(name))
    if name == "stop":
        return name, [v.encode().decode("unicode_escape") for v in values]  # "\n" as a stop
    if param.kind is str:
        if len(values) != 1:
            raise SlashError(f"{name} takes one value")
        if name == "speculative" and values[0] not in SPECULATIVE_CHOICES:
            raise SlashError(f"speculative must be one of {', '.join(SPECULATIVE_CHOICES)}")
        return name, values[0]
    if len(values) != 1:
        raise SlashError(f"{name} takes one value")
    text = values[0]
    try:
        value = param.kind(text)
        if not math.isfinite(value):
            raise ValueError(text)
    except ValueError:
        kind = "a whole number" if param.kind is int else "a number"
        raise SlashError(f"{name} must be {kind}, not '{text}'") from None
    if param.low is not None and value < param.low or \
            param.high is not None and value > param.high:
        bounds = f"from {param.low}" if param.high is None else \
            f"between {param.low} and {param.high}" if param.low is not None else \
            f"up to {param.high}"
        raise SlashError(f"{name} must be {bounds}, not {text}")
    return name, value


def completions(text: str, models: list[str] = ()) -> list[str]:
    """Whole-line completions of a partly typed command, in a stable order."""
    if not text.startswith("/") or "\n" in text:
        return []
    words = text.split(" ")
    if len(words) == 1:
        heads = ["/set", "/unset", "/show", "/load", "/save", "/chats", "/export", "/clear",
                 "/regen", "/stop", "/bye", "/?"]
        return [h for h in heads if h.startswith(words[0])]
    head = words[0]
    options: list[str] = []
    if head == "/set" and len(words) == 2:
        options = ["parameter", "system"]
    elif head == "/unset" and len(words) == 2:
        options = ["parameter"]
    elif head in ("/set", "/unset") and len(words) == 3 and words[1] == "parameter":
        options = list(PARAMETERS)
    elif head == "/show" and len(words) == 2:
        options = list(SHOW_WHAT)
    elif head == "/load" and len(words) == 2:
        options = list(models)
    elif head == "/?" and len(words) == 2:
        options = ["keys", "parameters"]
    prefix = " ".join(words[:-1])
    return [f"{prefix} {o}" for o in options if o.startswith(words[-1])]


def common_prefix(candidates: list[str]) -> str:
    if not candidates:
        return ""
    first, last = min(candidates), max(candidates)
    n = 0
    while n < len(first) and n < len(last) and first[n] == last[n]:
        n += 1
    return first[:n]


def help_text(topic: str = "") -> str:
    if topic == "parameters":
        rows = [f"  {name:<18} {p.help}" for name, p in PARAMETERS.items()]
        return "Parameters for /set parameter NAME VALUE:\n" + "\n".join(rows)
    width = max(len(usage) for usage, _ in COMMANDS)
    rows = [f"  {usage:<{width}}  {what}" for usage, what in COMMANDS]
    return ("Commands:\n" + "\n".join(rows) + '\n\nUse """ to begin and end a multi-line '
            "message. Ctrl+P opens the command palette.")
