"""systemd's protocols done for real: a process started the way socket activation starts it
(sockets bound by the parent, passed as fds 3.., LISTEN_FDS/LISTEN_PID) serves HTTP over them and
says READY=1 on NOTIFY_SOCKET; the generated units pass `systemd-analyze verify`."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import aiohttp
import pytest

from localllm.daemon import systemd
from localllm.cli.user_service import Listen, render_units

DEADLINE_S = 30

# What systemd does between fork and exec: move the sockets to fds 3.., then set LISTEN_PID to the
# pid the program will have (exec keeps it) and LISTEN_FDS to their count.
ACTIVATE = textwrap.dedent("""\
    import fcntl, os, sys
    fds = [int(fd) for fd in sys.argv[1].split(",")]
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
    for fd in fds:
        os.close(fd)
    for number, fd in enumerate(high, start=3):
        os.dup2(fd, number)
        os.close(fd)
    os.environ["LISTEN_FDS"] = str(len(fds))
    os.environ["LISTEN_PID"] = str(os.getpid())
    os.execv(sys.argv[2], sys.argv[2:])
""")

# A small aiohttp server that takes only inherited sockets, as the daemon's serve() does.
ACTIVATED_APP = textwrap.dedent("""\
    import asyncio, os, socket
    from aiohttp import web
    from localllm.daemon.systemd import listen_fds, notify

    async def main():
        sockets = listen_fds()
        families = sorted(socket.AddressFamily(s.family).name for s in sockets)
        async def hello(request):
            return web.json_response({"families": families,
                                      "listen_env": os.environ.get("LISTEN_FDS")})
        app = web.Application()
        app.router.add_get("/", hello)
        runner = web.AppRunner(app)
        await runner.setup()
        for sock in sockets:
            await web.SockSite(runner, sock).start()
        notify("READY=1")
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def _activate(program: list[str], sockets: list[socket.socket], env: dict,
              cwd: Path | None = None) -> subprocess.Popen:
    fds = [s.fileno() for s in sockets]
    return subprocess.Popen(
        [sys.executable, "-c", ACTIVATE, ",".join(map(str, fds)), *program],
        pass_fds=fds, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _notify_listener(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(DEADLINE_S)
    return sock


async def test_socket_activated_process_serves_on_inherited_unix_and_tcp_sockets(tmp_path):
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix_path = tmp_path / "localllm.sock"
    unix.bind(str(unix_path))
    unix.listen()
    tcp = socket.create_server(("127.0.0.1", 0))
    port = tcp.getsockname()[1]
    ready = _notify_listener(tmp_path / "notify")
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    child = _activate([sys.executable, "-c", ACTIVATED_APP], [unix, tcp], env)
    unix.close()  # the child holds them now, as when systemd keeps its copies
    tcp.close()
    try:
        message = await asyncio.to_thread(ready.recv, 256)
        assert message == b"READY=1"
        over_unix = aiohttp.ClientSession(connector=aiohttp.UnixConnector(str(unix_path)))
        async with over_unix as s, s.get("http://localllm/") as response:
            body = await response.json()
        assert body == {"families": ["AF_INET", "AF_UNIX"], "listen_env": None}
        async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/") as response:
            assert response.status == 200
    finally:
        child.kill()
        _, err = child.communicate()
        ready.close()
    assert b"Traceback" not in err, err.decode()


def test_listen_fds_ignores_sockets_meant_for_another_process(monkeypatch):
    monkeypatch.setenv("LISTEN_PID", str(os.getppid()))
    monkeypatch.setenv("LISTEN_FDS", "2")
    assert systemd.listen_fds() == []
    assert "LISTEN_FDS" not in os.environ and "LISTEN_PID" not in os.environ


@pytest.mark.parametrize("abstract", [False, True])
def test_notify_reaches_the_notify_socket(tmp_path, monkeypatch, abstract):
    if abstract:
        name = f"localllm-test-{os.getpid()}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        listener.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    else:
        listener = _notify_listener(tmp_path / "notify")
        monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    listener.settimeout(DEADLINE_S)
    with listener:
        assert systemd.notify("READY=1")
        assert listener.recv(64) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert systemd.notify("READY=1") is False


def test_journal_stream_is_recognised_only_on_the_stream_it_names(tmp_path):
    probe = "from localllm.daemon.systemd import journal_stream; print(journal_stream())"
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        stat = os.fstat(err.fileno())
        env = {**os.environ, "JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}
        on_it = subprocess.run([sys.executable, "-c", probe], env=env, stderr=err,
                               stdout=subprocess.PIPE, text=True)
    elsewhere = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                               text=True)
    assert on_it.stdout.strip() == "True"
    assert elsewhere.stdout.strip() == "False"


def _verify(unit_dir: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    # scripts/test.sh installs it (Debian package: systemd); a missing tool fails, not skips.
    assert shutil.which("systemd-analyze"), "systemd-analyze is not installed: apt install systemd"
    runtime = tmp_path / "verify-runtime"
    runtime.mkdir(mode=0o700)
    return subprocess.run(
        ["systemd-analyze", "verify", "--user", *sorted(map(str, unit_dir.iterdir()))],
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)}, capture_output=True, text=True)


@pytest.mark.parametrize("listen", [Listen("/run/user/1000/localllm/localllm.sock",
                                           "127.0.0.1:11435"),
                                    Listen("/tmp/a b/localllm.sock", "[::1]:11435")])
def test_generated_units_pass_systemd_analyze_verify(tmp_path, listen):
    # A path with a space and a '%' checks ExecStart's quoting: verify resolves the program.
    program = tmp_path / "my bin%" / "localllm"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    units = render_units([str(program), "serve"], listen,
                         {"XDG_CONFIG_HOME": "/home/u/my config", "LOCALLLM_MODELS": "/m"})
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    for name, text in units.items():
        (unit_dir / name).write_text(text)
    result = _verify(unit_dir, tmp_path)
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr


def test_verify_would_catch_a_broken_unit(tmp_path):
    """The check above can fail: an unknown option and a missing program are reported."""
    units = render_units([str(tmp_path / "missing" / "localllm"), "serve"],
                         Listen("/tmp/l.sock", "127.0.0.1:1"), {})
    unit_dir = tmp_path / "units"
    unit_dir.mkdir()
    for name, text in units.items():
        (unit_dir / name).write_text(text.replace("UMask=0077", "UMask=0077\nPrivateGPU=yes"))
    result = _verify(unit_dir, tmp_path)
    assert "PrivateGPU" in result.stderr and "is not executable" in result.stderr
