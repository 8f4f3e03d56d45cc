"""`localllm create NAME -f Modelfile`: Ollama's command, over the daemon's /api/create.

The Modelfile is read here; a FROM that names a file relative to it (`FROM ./model.gguf`) is
made absolute first, as Ollama reads it relative to the Modelfile's folder.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from localllm.cli.commands import config_from_args, refuse_to_replace
from localllm.client import Client
from localllm.errors import UserError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("create", help="create a model from a Modelfile",
                       description="Create NAME from a Modelfile: FROM a stored model or a GGUF "
                       "file, with PARAMETER, SYSTEM and TEMPLATE (a Jinja chat template) lines. "
                       "A model made FROM a stored one shares its weights (nothing is copied).")
    p.add_argument("model", metavar="NAME")
    p.add_argument("-f", "--file", type=Path, default=Path("Modelfile"),
                   help="the Modelfile (default: ./Modelfile)")
    p.add_argument("--force", action="store_true", help="replace a model already stored as NAME")
    # Ollama's flag, taken so that the daemon says in a sentence why it does not quantize
    p.add_argument("-q", "--quantize", metavar="QUANT", help="not supported: pull the quant "
                   "you want (`localllm pull NAME --quant Q`)")
    p.set_defaults(func=cmd_create)


def with_absolute_from(text: str, folder: Path) -> str:
    """FROM lines naming a file relative to the Modelfile, made absolute."""
    lines = []
    for line in text.splitlines():
        command, _, rest = line.strip().partition(" ")
        target = rest.strip()
        if command.upper() == "FROM" and target and not target.startswith(("/", "~")) and (
                target.startswith(".") or (folder / target).is_file()):
            line = f"FROM {(folder / target).resolve()}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def cmd_create(args) -> int:
    try:
        text = args.file.read_text()
    except FileNotFoundError:
        raise UserError(f"no Modelfile at {args.file}: -f names one") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the Modelfile {args.file}: {e}") from None
    replaced = refuse_to_replace(args.model, args.force)
    modelfile = with_absolute_from(text, args.file.resolve().parent)

    async def go() -> dict:
        async with Client(config_from_args(args)) as client:
            return await client.request("POST", "/api/create", {
                "model": args.model, "modelfile": modelfile, "stream": False,
                **({"quantize": args.quantize} if args.quantize else {})})
    answer = asyncio.run(go()) or {}
    notes = answer.get("notes") if isinstance(answer, dict) else None
    print(f"created {args.model}{replaced}" + (f" ({'; '.join(notes)})" if notes else ""))
    return 0
