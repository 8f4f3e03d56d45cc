"""Beyond this machine: `localllm worker` (lend a device to other machines' models over
llama.cpp's RPC) and `localllm remote add|list|rm` (models served by an OpenAI-compatible
server)."""

from __future__ import annotations

import argparse
import os
import re
from urllib.parse import urlsplit

from localllm.errors import UserError

DEFAULT_WORKER_PORT = 50052  # llama.cpp's rpc-server default
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "worker", help="lend this machine's GPU or CPU to other machines' models (RPC)",
        description="Serve a device of this machine to llama.cpp over RPC, for another "
        "machine whose config lists this one in rpc_workers. Loopback only unless --host says "
        "otherwise. RPC has no authentication: use it only on a network you trust.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_WORKER_PORT,
                   help=f"port to listen on ({DEFAULT_WORKER_PORT})")
    p.add_argument("--device", action="append", default=[], metavar="NAME",
                   help="device to serve: cpu, cuda0, cuda1... (repeatable; default: every GPU, "
                   "else the CPU)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads for a CPU device (default: physical cores)")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("remote", help="models served by an OpenAI-compatible server")
    remote = p.add_subparsers(dest="remote_command", metavar="COMMAND", required=True)
    add = remote.add_parser(
        "add", help="name a model that lives on an OpenAI-compatible server",
        description="Put into the store a model served elsewhere (vLLM, SGLang, llama-server, "
        "another localllm). Every route and `localllm run` then work with NAME; `localllm rm "
        "NAME` removes only the entry.")
    add.add_argument("name", help="NAME[:TAG] to call it here")
    add.add_argument("--url", required=True,
                     help="the server's OpenAI API base, e.g. http://host:8000/v1 (a URL "
                     "without a path gets /v1)")
    add.add_argument("--model", help="the server's name for the model (default: NAME)")
    add.add_argument("--api-key-env", default="", metavar="VAR",
                     help="environment variable of the daemon that holds the API key")
    add.add_argument("--force", action="store_true",
                     help="replace a model already stored as NAME")
    add.set_defaults(func=cmd_remote_add)
    listing = remote.add_parser("list", aliases=["ls"], help="list the remote models",
                                description="The remote models in the store: name, the "
                                "server's model name, its URL and the key's variable.")
    listing.set_defaults(func=cmd_remote_list)
    rm = remote.add_parser("rm", help="remove a remote model's entry",
                           description="Remove a remote model's entry from the store (the "
                           "server is not touched). Refuses a name that is a local model: "
                           "`localllm rm` removes those.")
    rm.add_argument("names", nargs="+", metavar="NAME")
    rm.set_defaults(func=cmd_remote_rm)


def cmd_worker(args) -> int:
    from localllm.planner.plan import physical_cores
    from localllm.engine.rpc import serve

    if not 0 < args.port < 65536:
        raise UserError(f"--port must be between 1 and 65535, not {args.port}")
    if args.threads < 0:
        raise UserError(f"--threads must be positive, not {args.threads}")
    devices = [_device_name(d) for d in args.device]
    return serve(args.host, args.port, devices, args.threads or physical_cores())


def _device_name(text: str) -> str:
    """`cpu` / `cuda0` as typed -> llama.cpp's device name (`CPU`, `CUDA0`)."""
    return text.strip().upper()


def normalize_url(text: str) -> str:
    """An OpenAI API base: http(s)://host[:port]/path, /v1 added to a bare host."""
    from localllm.modelstore.entries import shown_url

    parts = urlsplit(text.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"--url must be an http:// or https:// URL, not {shown_url(text)!r}")
    try:
        parts.port  # noqa: B018  (raises on a bad port)
    except ValueError:
        raise UserError(f"--url has an invalid port: {shown_url(text)!r}") from None
    path = parts.path.rstrip("/") or "/v1"
    return f"{parts.scheme}://{parts.netloc}{path}"


def cmd_remote_add(args) -> int:
    from localllm.modelstore.names import parse_name
    from localllm.modelstore.store import RemoteModel, default_store

    name = parse_name(args.name)  # BadModelName is a user error with its own message
    url = normalize_url(args.url)
    if args.api_key_env and not _ENV_NAME.match(args.api_key_env):
        raise UserError(f"--api-key-env must be an environment variable name, not "
                        f"{args.api_key_env!r}")
    upstream = args.model or name.base
    from .commands import refuse_to_replace

    replaced = refuse_to_replace(str(name), args.force)
    entry = default_store().add_remote(name, RemoteModel(url, upstream, args.api_key_env))
    note = ""
    if args.api_key_env and args.api_key_env not in os.environ:
        note = f" (set {args.api_key_env} in the daemon's environment)"
    print(f"added {entry.name}: {upstream} at {entry.remote.shown_url}{note}{replaced}")
    return 0


def cmd_remote_list(args) -> int:
    from localllm.modelstore.store import default_store

    from .commands import _table

    rows = [["NAME", "MODEL", "URL", "KEY"]]
    for entry in default_store().list():
        if entry.remote is not None:
            rows.append([str(entry.name), entry.remote.model, entry.remote.shown_url,
                         entry.remote.api_key_env or "-"])
    if len(rows) == 1:
        print("no remote models; add one with `localllm remote add NAME --url URL`")
    else:
        print(_table(rows))
    return 0


def cmd_remote_rm(args) -> int:
    from localllm.modelstore.store import default_store

    store = default_store()
    for name in args.names:
        entry = store.get(name)  # ModelNotFound: one line with what to do
        if entry.remote is None:
            raise UserError(f"'{entry.name}' is a local model, not a remote one; "
                            f"`localllm rm {name}` removes it")
        store.remove(entry.name)
        print(f"removed remote '{entry.name}'")
    return 0
