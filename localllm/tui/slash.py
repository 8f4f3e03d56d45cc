"""Slash commands, as `ollama run` has them: parsing, parameter checks, completion and help.

Pure functions of the typed line; the app carries the parsed `Command` out.
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.options import OPTIONS, OptionError, from_text


class SlashError(ValueError):
    """A line the user typed that is not a valid command; the message says what is."""


# The options `/set parameter` takes: the daemon's one option table, with its bounds.
PARAMETERS = OPTIONS

SHOW_WHAT = ("info", "parameters", "system", "template", "modelfile", "license", "plan")
# /set words of `ollama run` that have no meaning here, and why.
NOT_HERE = {"history": "prompt history is always kept (in the chat database)",
            "nohistory": "prompt history is always kept (in the chat database)",
            "wordwrap": "the chat wraps lines always", "nowordwrap": "the chat wraps lines always"}

# (usage, what it does), in the order /? lists them.
COMMANDS: tuple[tuple[str, str], ...] = (
    ("/set parameter NAME VALUE", "set a sampling or load option for the next answers"),
    ("/set system TEXT", "set the system message"),
    ("/set verbose|quiet", "print timings and speeds after each answer, or not"),
    ("/set format json|/set noformat", "answers in JSON (a grammar enforces it), or free text"),
    ("/set think|nothink", "ask a thinking model to think, or not"),
    ("/unset parameter NAME", "go back to the default for an option"),
    ("/show info|parameters|system|template|modelfile|license|plan",
     "show the model, the options or the plan"),
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
        word = rest[0].lower() if rest else ""
        if word in ("verbose", "quiet") and len(rest) == 1:
            return Command("set verbose", (word == "verbose",))
        if word in ("think", "nothink") and len(rest) == 1:
            return Command("set think", (word == "think",))
        if word == "noformat" and len(rest) == 1:
            return Command("set format", ("",))
        if word == "format":
            if [w.lower() for w in rest[1:]] != ["json"]:
                raise SlashError("usage: /set format json (or /set noformat)")
            return Command("set format", ("json",))
        if word in NOT_HERE:
            raise SlashError(f"/set {word} is not needed here: {NOT_HERE[word]}")
        raise SlashError("usage: /set parameter NAME VALUE, /set system TEXT, /set verbose|quiet, "
                         "/set format json|/set noformat, /set think|nothink")
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
    """A parameter's text value(s) -> its typed value, checked against the option table."""
    if name not in PARAMETERS:
        raise SlashError(unknown_parameter(name))
    if name == "stop":
        values = [v.encode().decode("unicode_escape") for v in values]  # "\n" as a stop
    try:
        value = from_text(name, values)
    except OptionError as e:
        raise SlashError(str(e)) from None
    return name, list(value) if name == "stop" else value


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
        options = ["parameter", "system", "verbose", "quiet", "format", "noformat", "think",
                   "nothink"]
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


def show_text(what: str, data: dict, model: str, options: dict | None = None,
              system: str = "") -> str:
    """`/show info|template|modelfile|license|parameters|system` from the daemon's /api/show
    answer; `options` and `system` are what this chat set, over the model's own."""
    if what == "parameters":
        own = [line for line in data.get("parameters", "").splitlines() if line.strip()]
        chat = [f"{k:<30} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                for k, v in (options or {}).items()]
        text = "\n".join([f"Model defined parameters ({model}):", *own] if own else [])
        if chat:
            text += ("\n\n" if text else "") + "\n".join(["Set in this chat:", *chat])
        return text or "No parameters set: the model's defaults apply."
    if what == "system":
        if system:
            return f"System message (set in this chat):\n{system}"
        if data.get("system"):
            return f"System message ({model}'s Modelfile):\n{data['system']}"
        return "No system message."
    if what == "template":
        return data.get("template") or f"{model} has no chat template."
    if what == "modelfile":
        return data.get("modelfile") or f"{model} has no Modelfile."
    if what == "license":
        return data.get("license") or f"{model} names no license."
    info, details = data.get("model_info", {}), data.get("details", {})
    arch = info.get("general.architecture", "")
    rows = [("architecture", arch),
            ("parameters", details.get("parameter_size", "")),
            ("quantization", details.get("quantization_level", "")),
            ("layers", info.get(f"{arch}.block_count", "")),
            ("context length", info.get(f"{arch}.context_length", "")),
            ("embedding length", info.get(f"{arch}.embedding_length", "")),
            ("chat template", "yes" if data.get("template") else "no")]
    return f"Model {model}\n" + "\n".join(f"  {k:<18} {v}" for k, v in rows)


def request_extra(format_: str, think: bool | None) -> dict:
    """The top-level /api/chat fields that /set format and /set think ask for."""
    extra: dict = {"format": format_} if format_ else {}
    if think is not None:
        extra["think"] = think
    return extra


# What /api/show gives as the template of a model that has none (Ollama's default): the
# messages' text goes to it as it is.
NO_TEMPLATE = ("", "{{ .Prompt }}")


def base_model_text(model: str) -> str:
    """The note for a model without a chat template: it was trained to continue text."""
    return (f"{model} has no chat template (a base model): it continues what you write rather "
            f"than answering it; your messages go to it as plain text.")
