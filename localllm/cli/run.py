"""`localllm run`: one answer streamed to stdout, or a chat (the TUI in a terminal, a line a
turn from a pipe); the model pulled first when it is not stored."""

from __future__ import annotations

import argparse
import asyncio
import sys

from localllm.cli.commands import config_from_args
from localllm.cli.suggest import known_model, model_names, nearest
from localllm.client import Client
from localllm.errors import UserError
from localllm.options import OptionError, from_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="answer a prompt, or chat, with a model",
                       description="Stream an answer to PROMPT and exit. Without a prompt, "
                       "chat: the full-screen chat in a terminal, a line a turn from stdin "
                       "otherwise (with /set parameter NAME VALUE, /set system, /bye). With a "
                       "prompt, piped stdin is added to it (`cat f.py | localllm run M "
                       "'explain'`). MODEL is a stored or catalog name, NAME:TAG, OWNER/REPO or "
                       "hf.co/...; one that is not stored is pulled. With no model, uses the "
                       "default (smollm2), fetching it on first use.")
    p.add_argument("words", nargs="*", metavar="[MODEL] PROMPT",
                   help="model name (optional) then the prompt")
    p.add_argument("--verbose", action="store_true", help="print timings and speeds after "
                   "the answer")
    p.add_argument("--keepalive", help="how long the model stays loaded (e.g. 5m, 0, -1)")
    p.add_argument("--ctx", type=option_flag("num_ctx"), help="context length (num_ctx); "
                   "past the model's trained context or what fits, it is capped, with a note")
    p.add_argument("--draft", metavar="MODEL", help="speculative decoding with MODEL drafting "
                   "(a stored model with the same vocabulary)")
    p.add_argument("--speculative", type=option_flag("speculative"), metavar="MODE",
                   help="how to draft: auto (the plan's choice, the default), off, lookup, mtp or "
                   "draft")
    p.add_argument("--resume", nargs="?", const="", metavar="CHAT",
                   help="reopen a saved chat by name or id (alone: pick from the list)")
    p.add_argument("--raw", action="store_true", help="send the prompt as it is, without "
                   "the chat template (a base model's way: it continues the text); no note "
                   "before pulling a base model")
    p.add_argument("--num-predict", type=option_flag("num_predict"), metavar="N",
                   help=f"most tokens for a one-shot answer (default {ONE_SHOT_NUM_PREDICT}; "
                   "-1: no cap); an answer that loops is stopped either way")
    p.add_argument("--format", choices=("json",), help="the answer as JSON (`--format json`)")
    p.add_argument("--think", nargs="?", const="true", type=think_flag, metavar="=LEVEL",
                   help="let a thinking model think and show its thinking; --think=false "
                        "answers without thinking, --think=low|medium|high sets its effort")
    p.add_argument("--hidethinking", action="store_true",
                   help="let a thinking model think, but print only its answer (a model that "
                        "does not think just answers)")
    p.add_argument("--nowordwrap", action="store_true",
                   help="print the answer as it comes, without wrapping words at the "
                        "terminal's edge")
    p.set_defaults(func=cmd_run, intermixed="words")  # options anywhere: run M --ctx 8192 hi


# ---- run ---------------------------------------------------------------------------------
ONE_SHOT_NUM_PREDICT = 1024  # a one-shot answer's default cap: `run hi > file` must end


def split_model_and_prompt(words: list[str], default_model: str, known,
                           candidates=lambda: ()) -> tuple[str, str]:
    """`run [MODEL] PROMPT`: the first word is a model when it names one we have or can fetch,
    or reads like a model reference (`name:tag`, `owner/repo`, `hf.co/...`): that one is
    pulled on use, as `ollama run` does.

    A mistyped model must never be answered by another model, so the first of two or more words
    that reads like a model name and is none is an error, as is a lone word close to a model
    name; a lone other word (`run hello`) and a quoted prompt go to the default model."""
    if not words:
        return default_model, ""
    first = words[0]
    if " " not in first and (known(first) or _looks_like_reference(first)):
        return first, " ".join(words[1:])
    if " " not in first and _looks_like_model(first):
        close = nearest(first, list(candidates()), cutoff=0.75)
        if len(words) > 1 or close:
            raise UserError(_no_such_model(first, close))
    return default_model, " ".join(words)


def _looks_like_reference(word: str) -> bool:
    """`name:tag`, `owner/repo[:quant]` or `hf.co/...`: no prompt is written so."""
    return ((":" in word or "/" in word) and not word.startswith(("/", ".", ":"))
            and not word.endswith((":", "/")) and _looks_like_model(word))


def _looks_like_model(word: str) -> bool:
    from localllm.modelstore.names import BadModelName, parse_name

    try:
        parse_name(word)
    except BadModelName:
        return False
    return True


def _no_such_model(name: str, close: str | None) -> str:
    hint = f"did you mean '{close}'? " if close else ""
    return (f"no model '{name}': it is not stored and not in the catalog; {hint}`localllm list` "
            "shows stored models, `localllm pull --list` the catalog (pull hf.co/OWNER/REPO:QUANT "
            "for others); to ask the default model, quote the whole prompt")


def cmd_run(args) -> int:
    config = config_from_args(args)
    model, prompt = split_model_and_prompt(args.words, config.default_model, known_model,
                                           model_names)
    # A lone word that could have been a model's name (`run llama3`) is said to be a prompt;
    # a quoted sentence (`run "Why is the sky blue?"`) plainly is one.
    if len(args.words) == 1 and model == config.default_model and prompt \
            and len(prompt.split()) == 1:
        print(f"note: no model is named {prompt!r}; {model} answers the prompt "
              f"{prompt!r}", file=sys.stderr)
    script: list[str] = []
    if prompt:
        prompt = with_piped_stdin(prompt)
    elif sys.stdin is not None and not sys.stdin.isatty():
        prompt, script = piped_prompt_or_script()
    return asyncio.run(_run_async(config, model, prompt, args, script))


def think_flag(text: str):
    """`--think`'s value as the API's `think`: a bool or an effort level."""
    value = text.lower()
    if value in ("true", "false"):
        return value == "true"
    if value in ("low", "medium", "high"):
        return value
    raise argparse.ArgumentTypeError("--think takes true, false, low, medium or high")


def option_flag(name: str):
    """An argparse type checking a flag's value against the option table (same bounds and
    message as the API's)."""
    def parse(text: str):
        try:
            return from_text(name, text)
        except OptionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = name  # argparse names the type in its own messages
    return parse


def with_piped_stdin(prompt: str) -> str:
    """`cat notes.txt | localllm run M "summarize"`: what is piped in is part of the prompt, as
    with `ollama run` (the typed words first, the piped text after them)."""
    if sys.stdin is None or sys.stdin.isatty():
        return prompt
    piped = sys.stdin.read()
    return f"{prompt}\n\n{piped.rstrip()}" if piped.strip() else prompt


def piped_prompt_or_script() -> tuple[str, list[str]]:
    """`printf 'Summarize:\\n...' | localllm run M`: all of stdin is one prompt, as `ollama run`
    sends it. Stdin that opens with a slash command or a triple-quote block is a chat script
    instead, read a turn at a time (its first lines are returned; the rest is read as it comes,
    so a program can answer each reply)."""
    first: list[str] = []
    for line in sys.stdin:
        first.append(line)
        if line.strip():
            break
    opening = "".join(first).strip()
    if not opening or opening.startswith(("/", '"""')):
        return "", first
    return (opening + "\n" + sys.stdin.read()).strip(), []


def run_options(args) -> dict:
    """The Ollama options `run`'s flags ask for."""
    options: dict = {}
    if args.ctx:
        options["num_ctx"] = args.ctx
    if args.draft:
        options.update(speculative="draft", draft_model=args.draft)
    if args.speculative:
        options["speculative"] = args.speculative
    return options


async def _run_async(config, model: str, prompt: str, args, script: list[str]) -> int:
    async with Client(config) as client:
        shown = await ensure_pulled(client, model, warn_base=not args.raw)
        extra = {}
        if args.keepalive is not None:
            extra["keep_alive"] = args.keepalive
        if args.format:
            extra["format"] = args.format
        think = args.think
        if args.hidethinking and think is None:
            # As `ollama run --hidethinking`: a thinking model thinks unseen, another just answers
            shown = shown or await client.request("POST", "/api/show", {"model": model})
            think = True if "thinking" in shown.get("capabilities", ()) else None
        if think is not None:
            extra["think"] = think
        options = run_options(args) or None
        if prompt:
            from localllm.image_paths import attach_images

            prompt, images = attach_images(prompt)
            message: dict = {"role": "user", "content": prompt}
            if images:
                message["images"] = [image.base64 for image in images]
                for image in images:
                    print(image.line(), file=sys.stderr)
            cap = ONE_SHOT_NUM_PREDICT if args.num_predict is None else args.num_predict
            one_shot = {**(options or {}), "num_predict": cap}
            if args.raw:  # /api/generate's raw mode: the prompt as it is, no template
                extra = {**extra, "raw": True,
                         **({"images": message["images"]} if images else {})}
            from localllm.cli.line_chat import stream_answer

            final = await stream_answer(
                client, model, [message], one_shot, extra, args.verbose, guard=True,
                raw=args.raw, show_thinking=think is not None and think is not False
                and not args.hidethinking,
                wrap=not args.nowordwrap and sys.stdout.isatty())
            if final.get("done_reason") == "cancelled":
                from localllm.cli.line_chat import cancelled_text

                raise UserError(cancelled_text(model))
            if args.ctx and 0 < final.get("context_length", 0) < args.ctx:
                print(await context_cap_note(client, model, args.ctx, final["context_length"]),
                      file=sys.stderr)
            if args.num_predict is None and final.get("done_reason") == "length":
                print(f"note: stopped at {cap} tokens, a one-shot run's cap; "
                      "--num-predict N (or -1) for longer answers", file=sys.stderr)
            return 0
        if sys.stdin.isatty():
            try:
                from localllm.tui.app import run_chat
            except ImportError:
                pass
            else:
                await client.close()
                return await run_chat(config, model, resume=args.resume, options=options)
        from localllm.cli.line_chat import chat_lines

        return await chat_lines(client, model, dict(options or {}), extra, args.verbose,
                                script)


async def ensure_pulled(client: Client, model: str, warn_base: bool = False) -> dict:
    """Pull the model through the daemon when it is not in the store yet; with warn_base, a
    catalog base model is named as one before its download starts. The model's /api/show
    answer when it was stored already, else {}."""
    from localllm.client import DaemonError

    try:
        return await client.request("POST", "/api/show", {"model": model})
    except DaemonError as e:
        if e.status != 404:
            raise
    if warn_base and (note := base_model_note(model)):
        print(note, file=sys.stderr)
    last = ""
    try:
        async for status in client.pull(model):
            line = status.get("status", "")
            if status.get("total"):
                pct = 100 * status.get("completed", 0) / status["total"]
                line = f"{line} {pct:5.1f}%"
            if line != last:
                print(f"\r{line:<60}", end="", file=sys.stderr, flush=True)
                last = line
    except DaemonError as e:
        if e.status == 404 and "pull" not in str(e):
            raise UserError(f"model '{model}' not found and it cannot be pulled: {e}") from None
        raise
    print(file=sys.stderr)
    return {}


async def context_cap_note(client: Client, model: str, asked: int, got: int) -> str:
    """The note for a --ctx the daemon capped: to what, and why (the model's trained context,
    or the memory here)."""
    info = (await client.request("POST", "/api/show", {"model": model})).get("model_info", {})
    trained = info.get(f"{info.get('general.architecture', '')}.context_length") or 0
    why = f"{model} was trained for {trained} tokens" if trained and asked > trained == got \
        else "a larger one does not fit in memory here (`localllm tune` says why)"
    return f"note: --ctx {asked} was capped at {got}: {why}"


def base_model_note(model: str) -> str:
    """The note for a catalog base model about to be pulled for `run`, else ""."""
    from localllm.modelstore import catalog

    entry = catalog.lookup(model)
    if entry is None or not entry.base:
        return ""
    chat = f"; `localllm run {entry.instruct}` is its instruct version" if entry.instruct else ""
    return (f"note: {model} is a base model: it continues text rather than answering it "
            f"(--raw sends the prompt as it is and skips this note){chat}")
