"""The real daemon, `localllm serve`, started the way localllm.socket starts it: it serves on the
sockets it inherits, tells systemd READY=1, and leaves the socket file (systemd's) in place when
it stops, so the next connection can start it again."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from datetime import datetime

import aiohttp
import pytest

from localllm.config import config_file
from test_systemd import DEADLINE_S, _activate, _notify_listener



async def test_localllm_serve_takes_the_sockets_systemd_passes(home, tmp_path):
    socket_path = tmp_path / "run" / "localllm.sock"
    socket_path.parent.mkdir(mode=0o700)
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(socket_path))
    unix.listen()
    tcp = socket.create_server(("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    ready = _notify_listener(tmp_path / "notify")
    # The config names other addresses: an activated daemon must not bind those itself.
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify"),
           "LOCALLLM_SOCKET": str(tmp_path / "not-this.sock"), "LOCALLLM_HOST": "127.0.0.1:1"}
    # systemd starts services in the home dir: nothing may depend on the working directory.
    daemon = _activate([sys.executable, "-m", "localllm.cli", "serve"], [unix, tcp], env,
                       cwd=tmp_path)
    unix.close()
    tcp.close()
    try:
        assert await asyncio.to_thread(ready.recv, 256) == b"READY=1"
        over_unix = aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(socket_path)))
        async with over_unix as s, s.get("http://localllm/api/version") as response:
            assert response.status == 200 and "version" in await response.json()
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as response:
            assert await response.text() == "Ollama is running"
        assert not (tmp_path / "not-this.sock").exists()

        daemon.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(ready.recv, 256) == b"STOPPING=1"
        assert await asyncio.to_thread(daemon.wait, DEADLINE_S) == 0
        assert socket_path.exists()  # systemd's socket outlives the daemon
    finally:
        daemon.kill()
        _, err = daemon.communicate()
        ready.close()
    assert b"Traceback" not in err, err.decode()


async def _load_and_expiry(session: aiohttp.ClientSession) -> float:
    """Load smollm2 (empty prompt) and return how many seconds /api/ps says it stays loaded."""
    async with session.post("http://localllm/api/generate", json={"model": "smollm2"}) as r:
        assert r.status == 200, await r.text()
    async with session.get("http://localllm/api/ps") as r:
        (model,) = (await r.json())["models"]
    expires = datetime.fromisoformat(model["expires_at"].replace("Z", "+00:00"))
    return expires.timestamp() - time.time()


def _save(path, text: str) -> None:
    draft = path.with_name(".config.toml.draft")  # the way editors save: write, then rename
    draft.write_text(text)
    draft.replace(path)


async def _stderr_line_with(daemon, needle: str) -> str:
    async def scan() -> str:
        while line := await asyncio.to_thread(daemon.stderr.readline):
            if needle.encode() in line:
                return line.decode()
        raise AssertionError(f"the daemon exited without logging {needle!r}")
    return await asyncio.wait_for(scan(), DEADLINE_S)


@pytest.mark.slow
async def test_editing_config_toml_changes_the_running_daemon(store, smollm2_gguf, tmp_path):
    store.import_gguf(smollm2_gguf, "smollm2")
    path = config_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('keep_alive = "5m"\n')
    socket_path = tmp_path / "localllm.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(socket_path))
    unix.listen()
    ready = _notify_listener(tmp_path / "notify")
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    daemon = _activate([sys.executable, "-m", "localllm.cli", "serve"], [unix], env, cwd=tmp_path)
    unix.close()
    session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(socket_path)))
    try:
        assert await asyncio.to_thread(ready.recv, 256) == b"READY=1"
        assert 200 < await _load_and_expiry(session) <= 300

        deadline = time.monotonic() + DEADLINE_S
        while await _load_and_expiry(session) < 3600:  # applied without a restart
            assert time.monotonic() < deadline, "keep_alive = 3h was not applied"
            _save(path, 'keep_alive = "3h"\n')  # again: the watcher may not have been up yet

        _save(path, 'keep_alive = "3h"\nmax_queue = "lots"\n')
        logged = await _stderr_line_with(daemon, "config invalid")
        assert f"{path}:2: max_queue must be a whole number" in logged
        assert await _load_and_expiry(session) > 3600  # still serving, with the last good config
    finally:
        await session.close()
        daemon.kill()
        daemon.communicate()
        ready.close()
