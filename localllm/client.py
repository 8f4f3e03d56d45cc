"""The API client the CLI and the TUI share: finds the daemon (Unix socket first, then TCP),
starts it in the background when it is not running, and turns its NDJSON back into events."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from . import paths
from .config import DAEMON_ONLY, ENV, Config, load_config
from .errors import UserError


class DaemonError(UserError):
    """The daemon answered with an error (its message is the user's to read)."""

    def __init__(self, message: str, status: int = 0):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Chunk:
    """One streamed line of /api/chat or /api/generate."""
    text: str
    done: bool
    data: dict  # the whole line: metrics on the last one


class Client:
    _noted = False  # the daemon-settings note is said once a process

    def __init__(self, config: Config | None = None):
        self.config = config or load_config()
        self._session: aiohttp.ClientSession | None = None
        self.base = ""

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session:
            await self._session.close()
            self._session = None

    def _headers(self) -> dict:
        if self.config.api_key:
            return {"Authorization": f"Bearer {self.config.api_key}"}
        return {}

    async def connect(self, start: bool = True) -> None:
        """Use the Unix socket when it answers, else TCP; start a daemon if neither does."""
        if self._session:
            return
        if await self._try_connect():
            await self._note_daemon_settings()
        elif start:
            daemon = start_daemon(self.config)
            deadline = time.monotonic() + 60
            while not await self._try_connect():
                if daemon.poll() is not None or time.monotonic() > deadline:
                    raise UserError(f"the daemon did not start ({last_log_line()}); "
                                    f"see {daemon_log_path()}")
                await asyncio.sleep(0.1)
        if not self._session:
            raise UserError("the localllm daemon is not running; start it with `localllm serve`")

    async def _note_daemon_settings(self) -> None:
        """One line on stderr when this command's environment sets a daemon-only variable
        that the daemon already running does not have: it changes nothing there."""
        mine = {ENV[n]: os.environ[ENV[n]] for n in DAEMON_ONLY if os.environ.get(ENV[n])}
        if not mine or Client._noted:
            return
        try:
            status = await self.request("GET", "/api/status")
        except (DaemonError, aiohttp.ClientError):
            return
        theirs = status.get("env", {})
        differ = [k for k, v in mine.items() if theirs.get(k) != v]
        if differ:
            Client._noted = True
            names = {v: k for k, v in ENV.items()}
            said = ", ".join(f"{k}={mine[k]}" for k in differ)
            print(f"note: {said} does not apply to the daemon already running (pid "
                  f"{status.get('pid')}); to apply it, restart the daemon with it set "
                  f"(`localllm stop --daemon`, then run this again) or save it for the next "
                  f"load with `localllm config set {names[differ[0]]} "
                  f"{mine[differ[0]]}`", file=sys.stderr)

    async def _try_connect(self) -> bool:
        sock = self.config.socket_path
        if sock.exists():
            session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(sock)),
                                            headers=self._headers())
            if await _ping(session, "http://localllm"):
                self._session, self.base = session, "http://localllm"
                return True
            await session.close()
        host, port = self.config.tcp
        if host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        base = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        session = aiohttp.ClientSession(headers=self._headers())
        if await _ping(session, base):
            self._session, self.base = session, base
            return True
        await session.close()
        return False

    async def request(self, method: str, path: str, body: dict | None = None) -> dict:
        await self.connect()
        async with self._session.request(method, self.base + path, json=body,
                                         timeout=aiohttp.ClientTimeout(total=None)) as resp:
            data = await _json(resp)
            if resp.status >= 400:
                raise DaemonError(_error_text(data, resp.status), resp.status)
            return data

    async def stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """POST and yield each NDJSON line; an {"error"} line raises DaemonError."""
        await self.connect()
        timeout = aiohttp.ClientTimeout(total=None, sock_read=None)
        async with self._session.post(self.base + path, json=body, timeout=timeout) as resp:
            if resp.status >= 400:
                raise DaemonError(_error_text(await _json(resp), resp.status), resp.status)
            async for line in resp.content:
                if not line.strip():
                    continue
                data = json.loads(line)
                if "error" in data:
                    raise DaemonError(str(data["error"]))
                yield data

    async def chat(self, model: str, messages: list[dict], options: dict | None = None,
                   **extra) -> AsyncIterator[Chunk]:
        body = {"model": model, "messages": messages, "stream": True, **extra}
        if options:
            body["options"] = options
        async for data in self.stream("/api/chat", body):
            yield Chunk(data.get("message", {}).get("content", ""), data.get("done", False), data)

    async def generate(self, model: str, prompt: str, options: dict | None = None,
                       **extra) -> AsyncIterator[Chunk]:
        body = {"model": model, "prompt": prompt, "stream": True, **extra}
        if options:
            body["options"] = options
        async for data in self.stream("/api/generate", body):
            yield Chunk(data.get("response", ""), data.get("done", False), data)

    async def pull(self, model: str) -> AsyncIterator[dict]:
        async for data in self.stream("/api/pull", {"model": model, "stream": True}):
            yield data

    async def stats(self) -> dict:
        """GET /api/stats: per loaded model, the runner's measured memory, plan and counters."""
        return await self.request("GET", "/api/stats")


async def _ping(session: aiohttp.ClientSession, base: str) -> bool:
    try:
        async with session.get(base + "/api/version",
                               timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False


async def _json(resp: aiohttp.ClientResponse) -> dict:
    text = await resp.text()
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {"error": text.strip() or resp.reason}


def _error_text(data: dict, status: int) -> str:
    error = data.get("error", f"HTTP {status}")
    if isinstance(error, dict):
        error = error.get("message", str(error))
    return str(error)


@dataclass(frozen=True)
class RunningDaemon:
    """The daemon a config reaches, from its GET /api/status."""
    pid: int
    started_at: str
    where: str  # the socket path, or the TCP URL it answered on
    local: bool  # reached over the Unix socket: a process of this user on this machine


async def running_daemon(config: Config | None = None) -> RunningDaemon | None:
    """The daemon that answers, or None when none does; never starts one."""
    client = Client(config)
    try:
        await client.connect(start=False)
    except UserError:
        return None
    try:
        status = await client.request("GET", "/api/status")
    finally:
        await client.close()
    local = client.base == "http://localllm"
    return RunningDaemon(int(status["pid"]), status.get("started_at", ""),
                         str(client.config.socket_path) if local else client.base, local)


def daemon_log_path() -> Path:
    """A background daemon's stdout and stderr: what it printed before its log was set up
    (a crash at start), the last start's only. Its log proper is localllm.log."""
    return paths.logs_dir() / "daemon.log"


def last_log_line() -> str:
    try:
        lines = daemon_log_path().read_text(errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    return lines[-1] if lines else "no log"


def serve_command() -> list[str]:
    """The installed `localllm serve`, as a systemd unit runs it (cli/user_service.py) and as a
    client starts it."""
    return [installed_command(), "serve"]


def installed_command() -> str:
    """The `localllm` command beside this Python (a virtual environment's or pipx's bin/), else
    the command being run (pip --user puts it elsewhere), else the one on PATH. An install
    without the command is a broken one: said so, not worked around."""
    beside = Path(sys.executable).parent / "localllm"
    argv0 = Path(sys.argv[0])
    for found in (beside, argv0 if argv0.name == "localllm" else None, shutil.which("localllm")):
        if found and os.access(found, os.X_OK) and Path(found).is_file():
            return os.path.abspath(found)
    raise UserError(f"the `localllm` command is not installed beside {sys.executable} nor on "
                    f"PATH; install localllm again (scripts/install.sh, or pip install)")


def start_daemon(config: Config) -> subprocess.Popen:
    """Start `localllm serve` detached from this terminal, logging to the state dir."""
    command = serve_command()
    with paths.open_private_log(daemon_log_path(), 0, 0, truncate=True) as log:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env={**os.environ},
        )


