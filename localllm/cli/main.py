"""The `localllm` command. Each subcommand's parser and handler live in a module of this room
(cli/); this file wires them together and turns known errors into one clear line."""

from __future__ import annotations

import argparse
import importlib
import sys

from localllm import __version__

# Modules that add their own subcommands: each has `register(subparsers)`, and the handlers it
# sets with `set_defaults(func=...)` take the parsed args and return an exit code. Each module's
# commands are named here too, so that a command imports only its own module: importing them
# all (their clients, the planner, the GGUF reader) took 0.44 s of every `localllm` call, 0.18
# s of it any one command's (tests/test_cli.py checks the names against what each registers).
COMMAND_MODULES = {
    "localllm.cli.commands": ("serve", "list", "ls", "show", "import", "rm", "cp", "ps", "stop"),
    "localllm.cli.run": ("run",),
    "localllm.cli.pull": ("pull",),  # and the quant pick
    "localllm.cli.tune": ("tune",),
    "localllm.cli.eval": ("eval",),
    "localllm.cli.service": ("service", "config"),
    "localllm.cli.cluster": ("worker", "remote"),
    "localllm.cli.launch": ("launch",),
    "localllm.cli.create": ("create",),  # Ollama's Modelfile command
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or only `command`'s subcommand where a module owns that name,
    none for `--version` (anything else, help and typos included, gets every command)."""
    parser = argparse.ArgumentParser(
        prog="localllm",
        description="Run large language models locally, planned for the GPU you have.",
    )
    parser.add_argument("-v", "--version", action="version", version=f"localllm {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    owners = [m for m, names in COMMAND_MODULES.items() if command in names] or \
        ([] if command in ("-v", "--version") else COMMAND_MODULES)
    for name in owners:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:  # a feature not built yet; its command is simply absent
                continue
            raise
        module.register(sub)
    parser.set_defaults(subcommands=sub.choices)  # a bad flag is told with its command's usage
    return parser


# Flags that Ollama gives a value only after `=` (`--think`, `--think=low`): argparse's optional
# value would take the next word (`run --think MODEL hi`), so the bare flag is spelled out first.
BARE_FLAGS = {"--think": "--think=true"}


def bare_flags(words: list[str]) -> list[str]:
    """The words with each bare BARE_FLAGS flag given its value, up to a `--`."""
    out = list(words)
    for i, word in enumerate(out):
        if word == "--":
            break
        out[i] = BARE_FLAGS.get(word, word)
    return out


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    first = words[0] if words else None
    parser = build_parser(first if first and (first in ("-v", "--version")
                                              or not first.startswith("-")) else None)
    args, extra = parser.parse_known_args(bare_flags(words))
    # A command whose words may sit between its options (`run M --ctx 8192 "hi"`) names them in
    # `intermixed`: argparse leaves the words after an option over, and they belong there.
    words = getattr(args, "intermixed", None)
    if extra and words and not any(w.startswith("-") for w in extra):
        getattr(args, words).extend(extra)
    elif extra:
        own = (getattr(args, "subcommands", None) or {}).get(getattr(args, "command", None))
        (own or parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handling below
        return code
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `localllm config show | head`: the reader has all it wanted
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the flush at exit does not complain
        return 0
    except Exception as e:
        from localllm.errors import user_message

        message = user_message(e)
        if message is None:
            raise
        from localllm.cli.suggest import with_suggestion

        print(f"Error: {with_suggestion(message)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
