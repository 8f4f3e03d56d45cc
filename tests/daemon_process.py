"""A real `localllm serve` in a subprocess, isolated in its own XDG dirs, for tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import urllib.request


# A Unix socket's path holds at most 107 bytes; the daemon's is RUNTIME/localllm/localllm.sock.
# A deep pytest folder (pytest-of-root/pytest-1001/test_a_long_name0/...) passes that.
RUNTIME_DIR_MAX = 107 - len("/localllm/localllm.sock")


def isolated_env(root: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCALLLM_")}
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME",
                "XDG_RUNTIME_DIR"):
        d = root / var.lower()
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        env[var] = str(d)
    if len(env["XDG_RUNTIME_DIR"]) > RUNTIME_DIR_MAX:  # pytest's folders outgrew a socket path
        env["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="llr-")
    env["LOCALLLM_HOST"] = "127.0.0.1:0"  # any free port; the daemon prints the one it got
    env.update(extra)
    return env


@dataclass
class Daemon:
    proc: subprocess.Popen
    env: dict
    url: str
    socket: Path

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return json.loads(resp.read())

    def ps(self) -> list[dict]:
        return self.get("/api/ps")["models"]

    def unload(self, model: str) -> None:
        """Unload `model` (keep_alive 0), so that the next test sharing this daemon loads it with
        the default options, not the num_ctx this one asked for."""
        body = json.dumps({"model": model, "keep_alive": 0}).encode()
        req = urllib.request.Request(self.url + "/api/generate", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()

    def cli(self, *args: str, input: str | None = None, timeout: float = 120):
        """Run the `localllm` command against this daemon."""
        env = {**self.env, "LOCALLLM_HOST": self.url.removeprefix("http://")}
        # No input: stdin is empty, never the test runner's own (run reads a piped stdin).
        stdin = subprocess.DEVNULL if input is None else None
        return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env,
                              input=input, stdin=stdin, capture_output=True, text=True,
                              timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# The log of every daemon the tests started: conftest checks each test added no error line to
# any of them unless the test says it causes errors on purpose.
DAEMON_LOGS: list[Path] = []


def start_daemon(env: dict, timeout: float = 60, python: str = sys.executable) -> Daemon:
    """The daemon of the checkout `python` has installed (this one's by default)."""
    DAEMON_LOGS.append(Path(env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log")
    proc = subprocess.Popen([python, "-m", "localllm.cli", "serve"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"daemon exited with {proc.wait()} before listening")
        if line.startswith("{"):
            info = json.loads(line)
            if info.get("event") == "listening":
                return Daemon(proc, env, f"http://{info['host']}:{info['port']}",
                              Path(info["socket"]))
    proc.kill()
    raise RuntimeError("daemon did not start listening in time")


def _polled(predicate, timeout: float, what: str):
    """Each poll's value of predicate(); fails once `timeout` has passed without a truthy one."""
    deadline = time.monotonic() + timeout
    while True:
        yield predicate()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def wait_for(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """Poll until predicate() is truthy; return its value, or fail after the deadline."""
    for value in _polled(predicate, timeout, what):
        if value:
            return value
        time.sleep(interval)  # ok-sleep: the poll interval of a deadline loop


async def wait_for_async(predicate, timeout: float, interval: float = 0.02,
                         what: str = "condition"):
    """wait_for in a test's event loop: the loop runs on while it polls."""
    import asyncio

    for value in _polled(predicate, timeout, what):
        if value:
            return value
        await asyncio.sleep(interval)  # ok-sleep: the poll interval of a deadline loop
