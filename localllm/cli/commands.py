"""The core commands: serve, list, show, import, rm, cp, ps, stop (run: cli/run.py)."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import sys
from dataclasses import replace
from pathlib import Path

from localllm import paths
from localllm.client import Client
from localllm.config import load_config
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

    p = sub.add_parser("list", aliases=["ls"], help="list stored models")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("show", help="show a model's architecture, size, capabilities, "
                       "parameters and license")
    p.add_argument("model")
    p.add_argument("--template", action="store_true", help="print only the chat template")
    p.add_argument("--modelfile", action="store_true", help="print its Modelfile (for "
                   "`localllm create NAME -f Modelfile`)")
    p.add_argument("--license", action="store_true", help="print only its license")
    p.add_argument("--parameters", action="store_true", help="print only its parameters")
    p.add_argument("--system", action="store_true", help="print only its system message")
    p.add_argument("-v", "--verbose", action="store_true", help="and every metadata key of "
                   "the GGUF (as `ollama show -v`)")
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("import", help="add a local GGUF file (or Ollama's models) to the store",
                       description="Verify FILE is a complete GGUF model and store it under "
                       "NAME (hard-linked when on the same filesystem, else copied). With "
                       "--from-ollama, the models of Ollama's store instead (all, or NAME).")
    p.add_argument("file", type=Path, nargs="?")
    p.add_argument("--name", help="NAME[:TAG] to store it as")
    p.add_argument("--from-ollama", nargs="?", const="", metavar="NAME", help="link the models "
                   "of Ollama's store ($OLLAMA_MODELS or ~/.ollama/models): all, or NAME")
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
    p.add_argument("--forget-crashes", nargs="?", const="", metavar="MODEL",
                   help="drop what the plans of MODEL (of every model, without one) leave off "
                        "because its runner crashed; its next load runs the plan as made")
    p.set_defaults(func=cmd_ps)

    p = sub.add_parser("stop", help="unload a model now, or stop the daemon (--daemon)")
    p.add_argument("model", nargs="?", help="the loaded model to unload (`localllm ps`)")
    p.add_argument("--daemon", action="store_true", help="stop the background daemon and its "
                   "runners (client commands start it again when needed)")
    p.set_defaults(func=cmd_stop)


def _run(coro) -> int:
    return asyncio.run(coro)


def config_from_args(args):
    """The config, with the --host and --socket a command was given on top."""
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

    config = config_from_args(args)
    paths.listen_address(config.host, config.api_key)  # one line, not a traceback, if bad
    setup_logging(config)  # the journal under systemd, else the log file and stderr
    asyncio.run(serve(config))
    return 0


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
        async with Client(config_from_args(args)) as client:
            return await client.request("GET", "/api/tags")
    data = _run(go())
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in data["models"]:
        rows.append([m["name"], m["digest"][:12], human_size(m["size"]), _ago(m["modified_at"])])
    print(_table(rows))
    for bad in data.get("damaged", ()):  # each on its own line, with what to do
        print(f"{bad['name']}: manifest damaged ({bad['error']}); `localllm rm {bad['name']}` "
              f"removes it")
    _print_aliases(data)
    return 0


def _print_aliases(data: dict, file=None) -> None:
    """The other names models answer to (the model_aliases setting), after list's and ps's
    tables (ps's on stderr, with its notes: its stdout is one line a model)."""
    for name, target in (data.get("aliases") or {}).items():
        print(f"alias {name} -> {target}", file=file)


def cmd_show(args) -> int:
    async def go():
        async with Client(config_from_args(args)) as client:
            return await client.request("POST", "/api/show", {"model": args.model})
    data = _run(go())
    for flag in ("template", "license", "parameters", "system"):  # as `ollama show --FLAG`
        if getattr(args, flag, False):
            print(data.get(flag, ""))
            return 0
    if args.modelfile:
        print(f"# Modelfile generated by \"localllm show\"\n# To build a new Modelfile based "
              f"on this, replace FROM with:\n# FROM {args.model}\n\n{data.get('modelfile', '')}")
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
    sections = show_sections(data)
    if args.verbose:
        sections.append(("Metadata", [f"{key:<40}{metadata_value(value)}" for key, value
                                      in sorted(info.items())]))
    for title, rows in sections:
        print(f"\n  {title}")
        for row in rows:
            print(f"    {row}".rstrip())
    return 0


def metadata_value(value) -> str:
    """A GGUF metadata value on one line: a long array (a vocabulary) by its first items."""
    if isinstance(value, list):
        shown = ", ".join(map(str, value[:5]))
        return f"[{shown}, ... {len(value)} items]" if len(value) > 5 else f"[{shown}]"
    return str(value)


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
    # The FROM line alone: SYSTEM, TEMPLATE and PARAMETER lines may follow it.
    path = data.get("modelfile", "").partition("\n")[0].removeprefix("FROM ").strip()
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

    if args.from_ollama is not None:
        from localllm.cli.ollama_import import import_from_ollama

        return import_from_ollama(args.from_ollama or None, args.force, copy=args.copy)
    if args.file is None or not args.name:
        raise UserError("import needs FILE.gguf and --name NAME (or --from-ollama [NAME])")
    replaced = refuse_to_replace(args.name, args.force)
    entry = default_store().import_gguf(args.file, args.name, link=not args.copy,
                                        projector=args.mmproj)
    print(f"imported {entry.name} ({entry.details.get('family')}, "
          f"{entry.details.get('parameter_size')}, {entry.details.get('quantization_level')}, "
          f"{human_size(entry.size)}){replaced}")
    return 0


def cmd_rm(args) -> int:
    async def go():
        async with Client(config_from_args(args)) as client:
            for name in args.models:
                await client.request("DELETE", "/api/delete", {"model": name})
                print(f"deleted '{name}'")
    _run(go())
    return 0


def cmd_cp(args) -> int:
    replaced = refuse_to_replace(args.destination, args.force)

    async def go():
        async with Client(config_from_args(args)) as client:
            await client.request("POST", "/api/copy",
                                 {"source": args.source, "destination": args.destination})
    _run(go())
    print(f"copied '{args.source}' to '{args.destination}'{replaced}")
    return 0


def _forget_crashes(args, model: str) -> int:
    async def go():
        async with Client(config_from_args(args)) as client:
            return await client.request("POST", "/api/crashes/forget",
                                        {"model": model} if model else {})
    forgotten = _run(go())["forgotten"]
    print(f"crash notes dropped for {', '.join(forgotten)}" if forgotten else
          f"no crash notes{' for ' + model if model else ''}")
    return 0


def cmd_ps(args) -> int:
    if args.forget_crashes is not None:
        return _forget_crashes(args, args.forget_crashes)

    async def go():
        async with Client(config_from_args(args)) as client:
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
    # One line a model on stdout, as `ollama ps` (scripts count them); the notes on each
    # model go to stderr, for the person reading
    def note(text: str) -> None:
        print(text, file=sys.stderr)

    _print_aliases(data, sys.stderr)
    for m in data["models"]:  # SIZE beside what the runner really holds, so neither surprises
        if m.get("rss_bytes"):
            note(f"{m['name']} memory: SIZE is its weights and KV cache as planned; its runner "
                 f"process holds {human_size(m['rss_bytes'])} of RAM (llama.cpp's buffers, the "
                 "file's pages read, the prompt cache, Python), the chat's \"runner RAM\"")
    for m in data["models"]:  # threads the runner dropped on a busy CPU, and why
        if m.get("threads_reason"):
            note(f"{m['name']} threads: {m['threads_reason']}")
    for m in data["models"]:  # what its plan leaves off after crashes, or on an AMX engine
        if m.get("crash_note"):
            note(f"{m['name']} after crashes: {m['crash_note']} (see the daemon log; "
                 f"`localllm ps --forget-crashes {m['name']}` turns it back on)")
        elif m.get("extra_bufts") is False:
            why = next((r for r in m.get("plan_reasons", ()) if "extra buffer types" in r),
                       "extra buffer types (repack, AMX) off")
            note(f"{m['name']} engine: {why}")
    for m in data["models"]:  # the driver refused to pin the weights in RAM where they are
        if m.get("pin_in_place") and m.get("weights_in_ram") == "copied":
            note(f"{m['name']} weights in RAM: copied into pinned memory, as the driver refused "
                 "to pin them in place (a slower load; see the daemon log)")
    for m in data["models"]:  # the MoE expert cache's slots and hit rate (issue #40)
        if m.get("expert_cache"):
            note(f"{m['name']} {m['expert_cache']['text']}")
    for m in data["models"]:  # decode as served against the plan's price (issue #65)
        if m.get("decode"):
            d = m["decode"]
            note(f"{m['name']} decode: {d['measured_tps']:.1f} tok/s measured, "
                 f"{d['predicted_tps']:.1f} predicted (over {d['tokens']} tokens)"
                 + ("; more than 15% off: a plan with work on the host is priced again "
                    "once idle" if d.get("off") else ""))
    for m in data["models"]:  # MoE ways priced too close to trust, measured in turn (#65)
        if m.get("ways"):
            rows = [f"{w['way']} {w['predicted_tps']:.1f} predicted" +
                    (f", {w['measured_tps']:.1f} measured" if w["measured_tps"] else "")
                    for w in m["ways"]["weighed"]]
            note(f"{m['name']} ways: {m['ways']['running']} running; " + "; ".join(rows))
    for m in data["models"]:  # the session the plan is made for, and whence
        if m.get("workload"):
            w = m["workload"]
            note(f"{m['name']} planned for: {w['planned_for']}"
                 + (f" ({w['source']})" if w.get("source") else ""))
    for m in data["models"]:  # plans per fill band: the one running, and the pauses so far
        if m.get("fill_band"):
            band = m["fill_band"]
            pauses = ", ".join(f"{p:.2f}s" for p in band["switch_pauses"]) or "none yet"
            note(f"{m['name']} fill band: up to {band['n_ctx']} tokens (bands "
                 f"{', '.join(str(b) for b in band['bands'])}); switch pauses: {pauses}")
    for m in data["models"]:  # a model spread over devices: its split, device by device
        if sum(1 for d in m.get("devices", ()) if d["device"] != "CPU" and d["layers"]) > 1 \
                or any(d["device"].startswith("RPC") for d in m.get("devices", ())):
            split = ", ".join(f"{d['device']} {d['layers']} layers ({human_size(d['size'])})"
                              for d in m["devices"])
            note(f"{m['name']} split: {split}")
    for m in data["models"]:  # a vision model: where its projector encodes images
        if m.get("projector"):
            p = m["projector"]
            note(f"{m['name']} vision projector: {p['device']}, about "
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
        return stop_daemon(config_from_args(args))
    if not args.model:
        raise UserError("name the model to unload (`localllm ps` lists them), or pass --daemon "
                        "to stop the daemon")

    async def go():
        async with Client(config_from_args(args)) as client:
            await client.request("POST", "/api/generate", {"model": args.model, "keep_alive": 0})
    _run(go())
    return 0


DAEMON_STOP_S = 30  # the daemon unloads its runners first; a large model can take a while


def stop_daemon(config) -> int:
    """SIGTERM to the daemon that answers, then wait until its process is gone."""
    import signal
    import time

    from localllm.client import running_daemon
    from localllm.cli import user_service

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
