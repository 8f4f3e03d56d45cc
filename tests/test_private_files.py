"""What another local user can read: nothing. Saved chats, saved profiles and every log are
0600 in 0700 folders; a prompt (with images, through mtmd) is in no log; runner.log is rotated
past a size; a background daemon writes one log, not two copies of it."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import ollama
from scripts import synth_vision
from daemon_process import isolated_env, start_daemon, wait_for
from localllm.modelstore.store import ModelStore
from test_vision import RED

SECRET = "quokka-zebra-4471 my bank PIN"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_an_image_prompt_is_in_no_log_and_the_logs_are_the_users_alone(tmp_path):
    env = isolated_env(tmp_path / "home")
    model, mmproj = synth_vision.write_vision_pair(tmp_path / "vl")
    ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(
        model, "vl", projector=mmproj)
    d = start_daemon(env)
    try:
        reply = ollama.Client(host=d.url).chat(
            model="vl", messages=[{"role": "user", "content": f"{SECRET}: what is this?",
                                   "images": [RED]}], options={"num_predict": 2})
        assert reply.prompt_eval_count > 64  # the image was read
    finally:
        d.stop()
    logs = Path(env["XDG_STATE_HOME"]) / "localllm" / "logs"
    assert mode(logs) == 0o700
    files = sorted(logs.iterdir())
    assert {p.name for p in files} >= {"localllm.log", "runner.log"}
    for path in files:
        assert mode(path) == 0o600, path
        assert "quokka" not in path.read_text(errors="replace"), path
    assert "clip" in (logs / "runner.log").read_text()  # mtmd's info lines are still there


def test_runner_log_is_rotated_past_its_size_at_a_runner_start(fresh_daemon):
    from localllm.daemon.logging_setup import LOG_FILE_BACKUPS, LOG_FILE_BYTES

    logs = Path(fresh_daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs"
    old = logs / "runner.log"
    old.write_bytes(b"x" * (LOG_FILE_BYTES + 1))
    for i in range(1, LOG_FILE_BACKUPS + 1):  # full backups: the oldest is dropped
        (logs / f"runner.log.{i}").write_bytes(str(i).encode())
    ollama.Client(host=fresh_daemon.url).generate(model="smollm2", prompt="hi",
                                                  options={"num_predict": 1})
    assert (logs / "runner.log.1").stat().st_size == LOG_FILE_BYTES + 1
    assert (logs / "runner.log.2").read_bytes() == b"1"
    assert (logs / f"runner.log.{LOG_FILE_BACKUPS}").read_bytes() == \
        str(LOG_FILE_BACKUPS - 1).encode()
    assert not (logs / f"runner.log.{LOG_FILE_BACKUPS + 1}").exists()
    assert 0 < old.stat().st_size < LOG_FILE_BYTES
    assert mode(old) == 0o600


def test_saved_chats_and_profiles_are_the_users_alone(home):
    from localllm.planner.plan import Plan
    from localllm.profiles.saved import profiles_dir, save_profile
    from localllm.tui.chatstore import ChatStore

    from localllm import paths

    paths.data_dir().mkdir(parents=True, mode=0o755)
    os.chmod(paths.data_dir(), 0o755)  # as a wider umask or an older version left it
    chats = ChatStore()
    chat = chats.create_chat("smollm2")
    chats.add_message(chat, "user", SECRET)
    for suffix in ("", "-wal", "-shm"):
        path = paths.data_dir() / f"chats.db{suffix}"
        if path.exists():
            assert mode(path) == 0o600, path
    chats.close()
    assert mode(paths.data_dir()) == 0o700
    path = save_profile(Plan(n_gpu_layers=0, n_ctx=2048), "smollm2:latest", "cpu", 1)
    assert mode(path) == 0o600 and mode(profiles_dir()) == 0o700


def test_a_background_daemon_writes_one_log_not_two(tmp_path):
    env = isolated_env(tmp_path / "home")
    started = subprocess.run([sys.executable, "-c", (
        "import asyncio; from localllm.client import Client\n"
        "async def main():\n"
        "    async with Client() as c:\n"
        "        await c.connect()\n"
        "        print((await c.request('GET', '/api/status'))['pid'])\n"
        "asyncio.run(main())")], env=env, capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.strip())
    # started as the installed command (localllm/client.py serve_command), as a unit starts it
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    assert str(Path(sys.executable).parent / "localllm") in argv and "serve" in argv, argv
    logs = Path(env["XDG_STATE_HOME"]) / "localllm" / "logs"
    try:
        wait_for(lambda: "listening" in (logs / "localllm.log").read_text(), 30,
                 what="the daemon's log line")
    finally:
        os.kill(pid, signal.SIGTERM)
    background = (logs / "daemon.log").read_text()
    assert "level=info" not in background  # its log lines are in localllm.log only
    assert json.loads(background.splitlines()[0])["event"] == "listening"
    assert mode(logs / "daemon.log") == 0o600 and mode(logs / "localllm.log") == 0o600
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or
             "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), 30,
             what="the daemon to stop")
