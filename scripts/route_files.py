#!/usr/bin/env python3
"""Which of the project's files one warm request crosses, in every process of the daemon's tree.

    python -m scripts.route_files                  # one plain POST /api/chat, streamed
    python -m scripts.route_files --route /v1/chat/completions
    python -m scripts.route_files --json           # the same, as JSON (tests read it)

Starts a real daemon on the small test model, loads it with a first request, then sends one
more request of the same kind and prints two counts of the files of ours that it runs:

- **to the first llama_decode** (issue #35's figure, "the files whose code runs between the HTTP
  handler and the runner's llama_decode"): the files, in any process of the tree (the daemon, the
  template worker, the runner), whose code is first called after the request is sent (so from
  the HTTP handler on, middleware included) and before the runner's first `llama_decode`.
- **the whole request**: every file of ours first called from the moment the request is sent
  until its answer has been read; this adds what runs after the first decode (the replies, the
  answer's writer, the traffic record, stats) and anything else the daemon ran meanwhile.

A profile hook that each process installs at start (a sitecustomize on PYTHONPATH) does the
recording. Switched on by SIGUSR1, it notes, by `time.monotonic()` (one clock for every process
on the machine), the first time each file's code runs (a function of it is called, or calls
another) from the moment the script sends the request (the script writes that moment into a
file every hook maps, just before sending), and the first call to `llama_cpp.llama_decode`
(wrapped while the hook is on); SIGUSR2 writes them out. Nothing of the project changes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import struct
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent



HOOK = '''
import os
if os.environ.get("ROUTE_FILES_DIR"):
    import json, mmap, signal, struct, sys, threading, time
    _dir = os.environ["ROUTE_FILES_DIR"]
    _clock = time.monotonic
    _first = {}  # file -> the time its code first ran since the request was sent
    _state = {"on": False, "sent": None, "decode": None, "real": None}

    def _sent():
        # When the request was sent, as the script writes it into the shared file just before
        # sending (infinity until then): nothing is noted before it.
        return struct.unpack_from("d", _state["sent"])[0]

    def _note(frame):
        name = frame.f_code.co_filename
        if name not in _first:
            now = _clock()
            if now >= _sent():
                _first[name] = now

    def _profile(frame, event, arg):
        # A call runs the callee's code and the caller's: a loop entered before the request
        # (the runner's command reader) makes calls for it, and so counts too.
        if _state["on"] and event == "call":
            _note(frame)
            if frame.f_back is not None:
                _note(frame.f_back)

    def _decode(ctx, batch, /):
        if _state["decode"] is None and _state["on"]:
            now = _clock()
            if now >= _sent():
                _state["decode"] = now
        return _state["real"](ctx, batch)

    def _start(*_):
        _first.clear()
        _state["decode"] = None
        with open(os.path.join(_dir, "sent"), "rb") as f:
            _state["sent"] = mmap.mmap(f.fileno(), 8, access=mmap.ACCESS_READ)
        lib = sys.modules.get("llama_cpp")
        if lib is not None and _state["real"] is None:
            _state["real"] = lib.llama_decode
            lib.llama_decode = _decode
        _state["on"] = True
        open(os.path.join(_dir, "on", str(os.getpid())), "w").close()

    def _stop(*_):
        _state["on"] = False
        lib = sys.modules.get("llama_cpp")
        if _state["real"] is not None:
            lib.llama_decode = _state["real"]
            _state["real"] = None
        out = os.path.join(_dir, "out", str(os.getpid()))
        with open(out + ".part", "w") as f:
            json.dump({"command": " ".join(sys.argv), "decode": _state["decode"],
                       "files": _first}, f)
        os.rename(out + ".part", os.path.join(_dir, "out", str(os.getpid()) + ".json"))

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
    """`path` as the project names it (localllm/daemon/api/ollama.py), or None for a file not
    ours."""
    parts = Path(path).parts
    if "site-packages" in parts or not path.endswith(".py") or "localllm" not in parts:
        return None
    return "/".join(parts[len(parts) - 1 - parts[::-1].index("localllm"):])


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


def done_when(check, what: str) -> None:
    """Poll `check()` until true (30 s at most; a file not there yet reads as false)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            if check():
                return
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not {what} in 30 s")
        time.sleep(0.05)


def wait_for(folder: Path, count: int, what: str, suffix: str = "") -> None:
    """Poll until `count` processes have left their file in `folder` (30 s at most)."""
    deadline = time.monotonic() + 30
    while len(list(folder.glob(f"*{suffix}"))) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"not every process of the daemon's tree did {what} in 30 s")
        time.sleep(0.05)


def process_name(command: str) -> str:
    """The daemon, the runner or the template worker, from a process's command line."""
    if "template_worker" in command:
        return "template worker"
    return "runner" if "runner" in command else "daemon"


def measure(route: str) -> dict:
    """Run one warm request on `route` under the hooks: {"processes": {name: {file: seconds
    from the request's sending to the file's first call}}, "decode": seconds to the runner's
    first llama_decode}."""
    from scripts import fetch_test_models
    from tests.daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    model = fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        hook, work = Path(tmp, "hook"), Path(tmp, "work")
        for folder in (hook, work / "on", work / "out"):
            folder.mkdir(parents=True)
        (hook / "sitecustomize.py").write_text(HOOK)
        sent_file = work / "sent"
        sent_file.write_bytes(struct.pack("d", math.inf))
        env = isolated_env(Path(tmp), LOCALLLM_CONTEXT_POLICY="fixed",
                           ROUTE_FILES_DIR=str(work))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "m")
        daemon = start_daemon(env)
        try:
            post(daemon.url, route)  # load the model, start the template worker
            # The first request's bookkeeping (below) over before the hooks go on: on a busy
            # machine its workload record was written after the second request was sent, and
            # counted as that one's (23 files to the first decode instead of 20).
            state = Path(env["XDG_STATE_HOME"]) / "localllm"
            done_when(lambda: f"POST {route} 200" in (state / "logs" / "localllm.log")
                      .read_text(), "log the first request")
            done_when((state / "workload.json").exists, "write the first workload record")
            pids = [daemon.proc.pid, *children(daemon.proc.pid)]
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            wait_for(work / "on", len(pids), "switch its hook on")
            with sent_file.open("r+b") as f:  # the hooks note nothing before this moment
                wall_sent = time.time()
                sent = time.monotonic()
                f.write(struct.pack("d", sent))
            post(daemon.url, route)
            # The request ends with its bookkeeping, not with the answer: its access-log line
            # and the tuner's workload record, written after the answer. Waited for, so that
            # they are counted every time rather than when they happen to be quick.
            done_when(lambda: (state / "logs" / "localllm.log").read_text().count(
                f"POST {route} 200") >= 2, "log the request")
            done_when(lambda: (state / "workload.json").stat().st_mtime >= wall_sent,
                      "write its workload record")
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
            wait_for(work / "out", len(pids), "write what it saw", suffix=".json")
        finally:
            daemon.stop()
        processes: dict[str, dict[str, float]] = {}
        decode = None
        for record in sorted((work / "out").glob("*.json")):
            seen = json.loads(record.read_text())
            files = processes.setdefault(process_name(seen["command"]), {})
            for path, at in seen["files"].items():
                name = ours(path)
                if name and (name not in files or at - sent < files[name]):
                    files[name] = at - sent
            if seen["decode"] is not None:
                at = seen["decode"] - sent
                decode = at if decode is None else min(decode, at)
    if decode is None:
        raise SystemExit("no llama_decode was seen in the runner: nothing to count up to")
    return {"route": route, "decode": decode, "processes": processes}


def counts(found: dict) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The files to the first llama_decode and those of the whole request, per process."""
    before = {p: sorted(f for f, at in files.items() if at < found["decode"])
              for p, files in found["processes"].items()}
    whole = {p: sorted(files) for p, files in found["processes"].items()}
    return before, whole


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", default="/api/chat", choices=sorted(BODIES))
    parser.add_argument("--json", action="store_true", help="print the files as JSON")
    args = parser.parse_args()
    found = measure(args.route)
    before, whole = counts(found)
    if args.json:
        print(json.dumps({"route": args.route, "to_first_decode": before, "whole": whole}))
        return
    decode = found["decode"]
    for process, files in found["processes"].items():
        print(f"## {process}: {len(before[process])} files to the first llama_decode, "
              f"{len(files)} in the whole request")
        marked = False
        for name, at in sorted(files.items(), key=lambda item: item[1]):
            if at >= decode and not marked:
                print(f"  {decode * 1000:8.1f} ms  -- the first llama_decode --")
                marked = True
            print(f"  {at * 1000:8.1f} ms  {name}")
    first = {f for files in before.values() for f in files}
    every = {f for files in whole.values() for f in files}
    print(f"\n{args.route}, warm: {len(first)} files of ours run from the HTTP handler to the "
          f"runner's first llama_decode ({decode * 1000:.1f} ms after sending); "
          f"{len(every)} in the whole request")


if __name__ == "__main__":
    main()
