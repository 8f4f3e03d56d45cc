#!/usr/bin/env python3
"""Which of the project's files run for one request, warm: the files a request crosses.

    python scripts/route_files.py                  # one plain POST /api/chat, streamed
    python scripts/route_files.py --route /v1/chat/completions

Starts a real daemon on the small test model, loads it with a first request, then records
every file of ours whose functions are called while one more request of the same kind runs,
in each process of the daemon's tree (the daemon, the runner, the template worker), and
prints them. A profile hook that each process installs at start (a sitecustomize on
PYTHONPATH) does the recording, switched on and off by SIGUSR1 and SIGUSR2; nothing of the
project changes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import checkout_imports  # noqa: E402

checkout_imports.bootstrap()

ROOMS = ("localllm", "daemon", "llama", "profiles", "modelstore", "cli", "tui")

HOOK = '''
import os
if os.environ.get("ROUTE_FILES_OUT"):
    import signal, sys, threading
    _seen, _on = set(), [False]

    def _profile(frame, event, arg):
        if _on[0] and event == "call":
            _seen.add(frame.f_code.co_filename)

    def _start(*_):
        _seen.clear()
        _on[0] = True

    def _stop(*_):
        _on[0] = False
        out = os.path.join(os.environ["ROUTE_FILES_OUT"], str(os.getpid()))
        with open(out, "w") as f:
            f.write(" ".join(sys.argv) + "\\n" + "\\n".join(sorted(_seen)))

    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    sys.setprofile(_profile)
    threading.setprofile(_profile)
'''

BODIES = {
    "/api/chat": {"messages": [{"role": "user", "content": "Say hello."}],
                  "options": {"num_predict": 8, "temperature": 0}},
    "/api/generate": {"prompt": "Say hello.", "options": {"num_predict": 8, "temperature": 0}},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hello."}],
                             "max_tokens": 8, "temperature": 0, "stream": True},
    "/v1/messages": {"messages": [{"role": "user", "content": "Say hello."}],
                     "max_tokens": 8, "temperature": 0, "stream": True},
    "/v1/responses": {"input": "Say hello.", "max_output_tokens": 8, "temperature": 0,
                      "stream": True},
}


def ours(path: str) -> str | None:
    """`path` as the project names it (daemon/api/ollama.py), or None for a file not ours. A
    checkout without an editable install reads localllm/<room>/... through a shim package."""
    parts = Path(path).parts
    if "site-packages" in parts or not path.endswith(".py"):
        return None
    for i, part in enumerate(parts):
        if part in ROOMS:
            if part == "localllm" and len(parts) > i + 2 and parts[i + 1] in ROOMS[1:]:
                i += 1
            return "/".join(parts[i:])
    return None


def post(url: str, route: str) -> None:
    body = json.dumps({"model": "m", **BODIES[route]}).encode()
    req = urllib.request.Request(url + route, data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out += [int(k) for k in kids]
    return out + [g for k in out for g in children(k)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", default="/api/chat", choices=sorted(BODIES))
    args = parser.parse_args()
    import fetch_test_models
    from daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    model = fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        hook, out = Path(tmp, "hook"), Path(tmp, "out")
        hook.mkdir()
        out.mkdir()
        (hook / "sitecustomize.py").write_text(HOOK)
        env = isolated_env(Path(tmp), LOCALLLM_CONTEXT_POLICY="fixed", ROUTE_FILES_OUT=str(out))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "m")
        daemon = start_daemon(env)
        try:
            post(daemon.url, args.route)  # load the model, start the template worker
            pids = [daemon.proc.pid, *children(daemon.proc.pid)]
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)  # signals are handled between bytecodes: let each take it
            post(daemon.url, args.route)
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            deadline = time.monotonic() + 30
            while len(list(out.iterdir())) < len(pids) and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            daemon.stop()
        total: set[str] = set()
        for record in sorted(out.iterdir()):
            command, *paths = record.read_text().splitlines()
            files = sorted({f for f in map(ours, paths) if f})
            total.update(files)
            print(f"## {command.split('/')[-1]} ({len(files)} files)")
            print("\n".join(f"  {f}" for f in files))
        print(f"\n{args.route}: {len(total)} files of ours run for one warm request")


if __name__ == "__main__":
    main()
