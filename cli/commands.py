"""The core commands: serve, run, list, show, import, rm, cp, ps, stop."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import difflib
import os
import sys
from dataclasses import replace
from pathlib import Path

from localllm import paths
from localllm.client import Client
from localllm.config import load_config
from localllm.options import OptionError, from_text
from localllm.errors import UserError
from localllm.units import human_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground",
                       description="Serve the Ollama and OpenAI APIs on the Unix socket and "
                       "on TCP (127.0.0.1:11435 unless --host or LOCALLLM_HOST says otherwise).")
    p.add_argument("--host", help="TCP address to bind, host:port (default 127.0.0.1:11435)")
    p.add_argument("--socket", help="Unix socket path (default $XDG_RUNTIME_DIR/localllm/"
                   "localllm.sock)")
    p.set_defaults(func=cmd_serve)

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
    p.set_defaults(func=cmd_run, intermixed="words")  # options anywhere: run M --ctx 8192 hi

    p = sub.add_parser("list", aliases=["ls"], help="list stored models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a model's architecture, size, capabilities, "
                       "parameters and license")
    p.add_argument("model")
    p.add_argument("--template", action="store_true", help="print only the chat template")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("import", help="add a local GGUF file to the store",
                       description="Verify FILE is a complete GGUF model and store it under "
                       "NAME (hard-linked when on the same filesystem, else copied).")
    p.add_argument("file", type=Path)
    p.add_argument("--name", required=True, help="NAME[:TAG] to store it as")
    p.add_argument("--copy", action="store_true", help="always copy, never hard-link")
    p.add_argument("--force", action="store_true", help="replace a model already stored as NAME")
    p.add_argument("--mmproj", type=Path, metavar="PROJ.gguf",
                   help="the model's vision projector, stored with it (images in chat)")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("rm", help="remove a model (unloading it first)")
    p.add_argument("models", nargs="+")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("cp", help="copy a model to a new name")
    p.add_argument("source")
    p.add_argument("destination")
    p.add_argument("--force", action="store_true", help="replace a model already stored as "
                   "DESTINATION")
    p.set_defaults(func=cmd_cp)

    p = sub.add_parser("ps", help="list loaded models with their memory and plan")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="unload a model now, or stop the daemon (--daemon)")
    p.add_argument("model", nargs="?", help="the loaded model to unload (`localllm ps`)")
    p.add_argument("--daemon", action="store_true", help="stop the background daemon and its "
                   "runners (client commands start it again when needed)")
    p.set_defaults(func=cmd_stop)


def _run(coro) -> int:
    return asyncio.run(coro)


def _config(args):
    config = load_config()
    if getattr(args, "host", None):
        os.environ["LOCALLLM_HOST"] = args.host  # runners and children see the same address
        config = replace(config, host=args.host)
    if getattr(args, "socket", None):
        config = replace(config, socket=args.socket)
    return config


# ---- serve -------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    from localllm.daemon.logging_setup import setup_logging
    from localllm.daemon.server import serve

    config = _config(args)
    paths.listen_address(config.host, config.api_key)  # one line, not a traceback, if bad
    setup_logging(config)  # the journal under systemd, else the log file and stderr
    asyncio.run(serve(config))
    return 0


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
        close = difflib.get_close_matches(first.lower(), list(candidates()), n=1, cutoff=0.75)
        if len(words) > 1 or close:
            raise UserError(_no_such_model(first, close[0] if close else None))
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


def _known_model(name: str) -> bool:
    from localllm.modelstore import catalog
    from localllm.modelstore.names import BadModelName, parse_name
    from localllm.modelstore.store import default_store

    try:
        parsed = parse_name(name)
    except BadModelName:
        return False
    if name.startswith(("hf.co/", "huggingface.co/", "https://")):
        return True
    return default_store().exists(parsed) or catalog.lookup(parsed) is not None


def _model_names() -> list[str]:
    """Stored and catalog names, as a user types them, for "did you mean"."""
    from localllm.modelstore import catalog
    from localllm.modelstore.store import default_store

    names = [str(e.name) for e in default_store().list()]
    names += [str(name) for name in catalog.load_catalog()]
    return sorted({n.removesuffix(":latest") for n in names})


def cmd_run(args) -> int:
    config = _config(args)
    model, prompt = split_model_and_prompt(args.words, config.default_model, _known_model,
                                           _model_names)
    # A lone word that could have been a model's name (`run llama3`) is said to be a prompt;
    # a quoted sentence (`run "Why is the sky blue?"`) plainly is one.
    if len(args.words) == 1 and model == config.default_model and prompt \
            and len(prompt.split()) == 1:
        print(f"note: no model is named {prompt!r}; {model} answers the prompt "
              f"{prompt!r}", file=sys.stderr)
    if prompt:
        prompt = with_piped_stdin(prompt)
    return _run(_run_async(config, model, prompt, args))


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


async def _run_async(config, model: str, prompt: str, args) -> int:
    async with Client(config) as client:
        await ensure_pulled(client, model, warn_base=not args.raw)
        extra = {}
        if args.keepalive is not None:
            extra["keep_alive"] = args.keepalive
        options = run_options(args) or None
        if prompt:
            from localllm.cli.image_paths import attach_images

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
            final = await _answer(client, model, [message], one_shot, extra, args.verbose,
                                  guard=True, raw=args.raw)
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
        await _chat_lines(client, model, dict(options or {}), extra, args.verbose)
    return 0


async def _chat_lines(client: Client, model: str, options: dict, extra: dict,
                      verbose: bool) -> None:
    """Chat over stdin, a line a turn, for pipes and scripts; `/set parameter NAME VALUE`,
    `/set system TEXT` and `/bye` work as in `ollama run`."""
    from localllm.tui.slash import SlashError, parse_parameter

    history: list[dict] = []
    for raw in sys.stdin:
        line = raw.strip()
        if not line:
            continue
        if line in ("/bye", "/exit"):
            break
        if line.startswith("/"):
            words = line.split()
            try:
                if words[:2] == ["/set", "parameter"] and len(words) >= 4:
                    name, value = parse_parameter(words[2], words[3:])
                    options[name] = value
                elif words[:2] == ["/set", "system"] and len(words) >= 3:
                    history = [m for m in history if m["role"] != "system"]
                    history.insert(0, {"role": "system", "content": line.split(None, 2)[2]})
                else:
                    raise SlashError(f"unknown command '{words[0]}' here; use /set parameter "
                                     "NAME VALUE, /set system TEXT or /bye")
            except SlashError as e:
                print(f"Error: {e}", file=sys.stderr)
            continue
        history.append({"role": "user", "content": raw.rstrip("\n")})
        final = await _answer(client, model, history, options or None, extra, verbose,
                              guard=True)
        history.append({"role": "assistant", "content": final.get("text", "")})


async def ensure_pulled(client: Client, model: str, warn_base: bool = False) -> None:
    """Pull the model through the daemon when it is not in the store yet; with warn_base, a
    catalog base model is named as one before its download starts."""
    from localllm.client import DaemonError

    try:
        await client.request("POST", "/api/show", {"model": model})
        return
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


async def _answer(client: Client, model: str, messages: list[dict], options, extra,
                  verbose: bool, guard: bool = False, raw: bool = False) -> dict:
    """Stream one answer to stdout; the last line's data, with the whole text as `text`.
    With `guard`, an answer caught in a loop is cut off (closing the stream stops the model).
    With `raw`, the one message's text goes to /api/generate as it is (extra says raw)."""
    parts = []
    tail = ""  # the end of the answer, where a loop shows
    final: dict = {}
    looping = 0
    stream = client.generate(model, messages[-1]["content"], options, **extra) if raw else \
        client.chat(model, messages, options, **extra)
    async for chunk in stream:
        if chunk.text:
            parts.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            tail = (tail + chunk.text)[-4 * LOOP_SPAN:]
        if chunk.done:
            final = chunk.data
        elif guard and chunk.text and (looping := repeating_tail(tail)):
            break
    sys.stdout.write("\n")
    sys.stdout.flush()
    if looping:
        print(f"note: stopped: the answer kept repeating the same {looping} characters",
              file=sys.stderr)
    if verbose and final:
        print(format_timings(final), file=sys.stderr)
    return {**final, "text": "".join(parts)}


LOOP_SPAN = 240  # characters a repeated stretch must cover before it counts as a loop
LOOP_REPEATS = 4  # and the fewest times its unit must repeat


def repeating_tail(text: str, longest: int = 200) -> int:
    """The length of the unit the end of `text` repeats (`1 1 1 1 ...`, the same sentence over
    and over), when it covers LOOP_SPAN characters and LOOP_REPEATS units; else 0."""
    for period in range(1, longest + 1):
        repeats = max(LOOP_REPEATS, -(-LOOP_SPAN // period))
        span = period * repeats
        if span > len(text):
            break
        unit = text[-period:]
        if unit.strip() and text[-span:] == unit * repeats:
            return period
    return 0


def format_timings(final: dict) -> str:
    """The block `ollama run --verbose` prints after an answer."""
    def rate(count, ns):
        return f"{count / (ns / 1e9):.2f} tokens/s" if ns else "n/a"

    draft = final.get("stats", {}).get("draft")
    drafts = [f"drafts accepted:      {draft['accepted']}/{draft['drafted']}"] if draft else []
    return "\n".join([
        f"total duration:       {final.get('total_duration', 0) / 1e9:.3f}s",
        f"load duration:        {final.get('load_duration', 0) / 1e9:.3f}s",
        f"prompt eval count:    {final.get('prompt_eval_count', 0)} token(s)",
        f"prompt eval duration: {final.get('prompt_eval_duration', 0) / 1e9:.3f}s",
        f"prompt eval rate:     "
        f"{rate(final.get('prompt_eval_count', 0), final.get('prompt_eval_duration', 0))}",
        f"eval count:           {final.get('eval_count', 0)} token(s)",
        f"eval duration:        {final.get('eval_duration', 0) / 1e9:.3f}s",
        f"eval rate:            {rate(final.get('eval_count', 0), final.get('eval_duration', 0))}",
        *drafts,
    ])


# ---- store commands ----------------------------------------------------------------------


def _ago(iso_time: str) -> str:
    seconds = (dt.datetime.now(dt.UTC) - dt.datetime.fromisoformat(iso_time)).total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("    ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                     for r in rows)


def cmd_list(args) -> int:
    async def go():
        async with Client(_config(args)) as client:
            return await client.request("GET", "/api/tags")
    data = _run(go())
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in data["models"]:
        rows.append([m["name"], m["digest"][:12], human_size(m["size"]), _ago(m["modified_at"])])
    print(_table(rows))
    return 0


def cmd_show(args) -> int:
    async def go():
        async with Client(_config(args)) as client:
            return await client.request("POST", "/api/show", {"model": args.model})
    data = _run(go())
    if args.template:
        print(data.get("template", ""))
        return 0
    info, details = data["model_info"], data["details"]
    arch = info["general.architecture"]
    if arch == "remote":  # served elsewhere (`localllm remote add`): no file to describe
        print(f"  Model\n    {'remote':<20}{info['remote.model']} at {info['remote.url']}")
        return 0
    lines = [
        ("architecture", arch),
        ("parameters", details.get("parameter_size", "")),
        ("quantization", details.get("quantization_level", "")),
        ("layers", str(info.get(f"{arch}.block_count", ""))),
        ("context length", str(info.get(f"{arch}.context_length", ""))),
        ("embedding length", str(info.get(f"{arch}.embedding_length", ""))),
    ]
    if info.get(f"{arch}.attention.sliding_window"):
        lines.append(("sliding window", str(info[f"{arch}.attention.sliding_window"])))
    if info.get(f"{arch}.expert_count"):
        lines.append(("experts", str(info[f"{arch}.expert_count"])))
    if info.get(f"{arch}.nextn_predict_layers"):
        lines.append(("MTP layers", str(info[f"{arch}.nextn_predict_layers"])))
    lines.append(("chat template", chat_template_line(data.get("template", ""))))
    lines.append(("file size", human_size(data.get("size", 0)) if data.get("size") else
                  _file_size(data)))
    print("  Model")
    for key, value in lines:
        print(f"    {key:<20}{value}")
    for title, rows in show_sections(data):
        print(f"\n  {title}")
        for row in rows:
            print(f"    {row}".rstrip())
    return 0


def show_sections(data: dict) -> list[tuple[str, list[str]]]:
    """`ollama show`'s sections after Model, from /api/show: Capabilities, Parameters, System
    and License (a long text shortened to its first lines, as Ollama does)."""
    def first_lines(text: str, n: int = 2) -> list[str]:
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return lines[:n] + (["..."] if len(lines) > n else [])

    sections = []
    if data.get("capabilities"):
        sections.append(("Capabilities", list(data["capabilities"])))
    params = [line.split(None, 1) for line in data.get("parameters", "").splitlines()
              if line.strip()]
    if params:
        sections.append(("Parameters", [f"{p[0]:<20}{p[1] if len(p) > 1 else ''}"
                                        for p in params]))
    if data.get("system", "").strip():
        sections.append(("System", first_lines(data["system"])))
    if data.get("license", "").strip():
        sections.append(("License", first_lines(data["license"])))
    return sections


def chat_template_line(template: str) -> str:
    """`show`'s chat-template row; the daemon reports Ollama's default template for a model
    that brings none (a base model), and chat then sends the user messages' text as it is."""
    if template == "{{ .Prompt }}":
        return "default ({{ .Prompt }}: chat sends the user messages' text as it is)"
    return "yes" if template else "no"


def _file_size(data: dict) -> str:
    path = data.get("modelfile", "").removeprefix("FROM ").strip()
    try:
        return human_size(Path(path).stat().st_size)
    except OSError:
        return "?"


def refuse_to_replace(name: str, force: bool) -> str:
    """Names are never replaced by accident: without --force a stored name is an error; with
    it, the words that say what was replaced ("" when the name was free)."""
    from localllm.modelstore.store import default_store

    if not default_store().exists(name):
        return ""
    if not force:
        raise UserError(f"'{name}' already exists; pass --force to replace it, or pick "
                        "another name")
    return f" (replaced the model that was '{name}')"


def cmd_import(args) -> int:
    from localllm.modelstore.store import default_store

    replaced = refuse_to_replace(args.name, args.force)
    entry = default_store().import_gguf(args.file, args.name, link=not args.copy,
                                        projector=args.mmproj)
    print(f"imported {entry.name} ({entry.details.get('family')}, "
          f"{entry.details.get('parameter_size')}, {entry.details.get('quantization_level')}, "
          f"{human_size(entry.size)}){replaced}")
    return 0


def cmd_rm(args) -> int:
    async def go():
        async with Client(_config(args)) as client:
            for name in args.models:
                await client.request("DELETE", "/api/delete", {"model": name})
                print(f"deleted '{name}'")
    _run(go())
    return 0


def cmd_cp(args) -> int:
    replaced = refuse_to_replace(args.destination, args.force)

    async def go():
        async with Client(_config(args)) as client:
            await client.request("POST", "/api/copy",
                                 {"source": args.source, "destination": args.destination})
    _run(go())
    print(f"copied '{args.source}' to '{args.destination}'{replaced}")
    return 0


def cmd_ps(args) -> int:
    async def go():
        async with Client(_config(args)) as client:
            return await client.request("GET", "/api/ps")
    data = _run(go())
    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "THREADS", "CONTEXT", "SLOTS", "KV", "UNTIL"]]
    for m in data["models"]:
        until = m["expires_at"]
        if until.startswith("2318"):
            until = "Forever"
        else:
            seconds = (dt.datetime.fromisoformat(until.replace("Z", "+00:00"))
                       - dt.datetime.now(dt.UTC)).total_seconds()
            until = f"{max(0, int(seconds // 60))} minutes from now" if seconds >= 60 else \
                f"{max(0, int(seconds))} seconds from now"
        rows.append([m["name"], m["digest"][:12], human_size(m["size"]),
                     m.get("processor", ""), threads_cell(m), str(m["context_length"]),
                     f"{m.get('active', 0)}/{m.get('num_parallel', 1)}", m.get("kv_type", ""),
                     until])
    print(_table(rows))
    for m in data["models"]:  # threads the runner dropped on a busy CPU, and why
        if m.get("threads_reason"):
            print(f"{m['name']} threads: {m['threads_reason']}")
    for m in data["models"]:  # plans per fill band: the one running, and the pauses so far
        if m.get("fill_band"):
            band = m["fill_band"]
            pauses = ", ".join(f"{p:.2f}s" for p in band["switch_pauses"]) or "none yet"
            print(f"{m['name']} fill band: up to {band['n_ctx']} tokens (bands "
                  f"{', '.join(str(b) for b in band['bands'])}); switch pauses: {pauses}")
    for m in data["models"]:  # a model spread over devices: its split, device by device
        if sum(1 for d in m.get("devices", ()) if d["device"] != "CPU" and d["layers"]) > 1 \
                or any(d["device"].startswith("RPC") for d in m.get("devices", ())):
            split = ", ".join(f"{d['device']} {d['layers']} layers ({human_size(d['size'])})"
                              for d in m["devices"])
            print(f"{m['name']} split: {split}")
    for m in data["models"]:  # a vision model: where its projector encodes images
        if m.get("projector"):
            p = m["projector"]
            print(f"{m['name']} vision projector: {p['device']}, about "
                  f"{p['seconds_per_image']:.2f}s per image")
    return 0


def threads_cell(model: dict) -> str:
    """Threads in use, with the plan's count when the runner dropped some (a busy CPU)."""
    used, planned = model.get("threads"), model.get("planned_threads")
    if used is None:
        return ""
    return f"{used} of {planned}" if planned and planned != used else str(used)


def cmd_stop(args) -> int:
    if args.daemon:
        if args.model:
            raise UserError("stop --daemon stops the whole daemon: leave out the model name")
        return stop_daemon(_config(args))
    if not args.model:
        raise UserError("name the model to unload (`localllm ps` lists them), or pass --daemon "
                        "to stop the daemon")

    async def go():
        async with Client(_config(args)) as client:
            await client.request("POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    _run(go())
    return 0


DAEMON_STOP_S = 30  # the daemon unloads its runners first; a large model can take a while


def stop_daemon(config) -> int:
    """SIGTERM to the daemon that answers, then wait until its process is gone."""
    import signal
    import time

    from localllm.client import running_daemon
    from localllm.daemon import user_service

    daemon = _run(running_daemon(config))
    if daemon is None:
        print("no localllm daemon is running")
        return 0
    if not daemon.local and not own_daemon_process(daemon.pid):
        raise UserError(f"the daemon at {daemon.where} is not a process of yours on this "
                        "machine: stop it where it runs")
    try:
        os.kill(daemon.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass  # it ended on its own in between
    except PermissionError:
        raise UserError(f"not allowed to stop the daemon (pid {daemon.pid}): it is not "
                        "yours") from None
    deadline = time.monotonic() + DAEMON_STOP_S
    while not process_gone(daemon.pid):
        if time.monotonic() > deadline:
            raise UserError(f"the daemon (pid {daemon.pid}) is still running {DAEMON_STOP_S} s "
                            "after being asked to stop; `localllm service logs` says why")
        time.sleep(0.05)  # ok-sleep: the poll interval of a deadline loop
    again = " (its systemd socket starts it again on the next request)" \
        if user_service.read_manifest() is not None else ""
    print(f"stopped the localllm daemon (pid {daemon.pid}){again}")
    return 0


def own_daemon_process(pid: int) -> bool:
    """A daemon reached over TCP is ours to stop only when its pid here is our `localllm`."""
    proc = Path(f"/proc/{pid}")
    try:
        return proc.stat().st_uid == os.getuid() and b"localllm" in \
            (proc / "cmdline").read_bytes()
    except OSError:
        return False


def process_gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (its parent has not collected it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")
