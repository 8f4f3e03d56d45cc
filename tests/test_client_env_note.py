"""A client command run with a daemon-only variable against a daemon that is already running
says, in one line, that it does not apply there and how to apply it. A real daemon, the real
CLI in a subprocess."""

from __future__ import annotations

import subprocess
import sys


def localllm(daemon, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args],
                          env={**daemon.env, **env}, capture_output=True, text=True, timeout=120)


def test_a_daemon_only_variable_against_a_running_daemon_is_named(daemon):
    plain = localllm(daemon, "ps")
    assert plain.returncode == 0 and "note:" not in plain.stderr, plain.stderr
    result = localllm(daemon, "ps", LOCALLLM_CONTEXT_LENGTH="8192", LOCALLLM_KV_CACHE_TYPE="q8_0")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, result.stderr
    note = notes[0]
    assert "LOCALLLM_CONTEXT_LENGTH=8192" in note and "LOCALLLM_KV_CACHE_TYPE=q8_0" in note
    assert f"daemon already running (pid {daemon.get('/api/status')['pid']})" in note
    assert "localllm stop --daemon" in note and "localllm config set default_ctx 8192" in note
    # A variable the client itself reads (where to reach the daemon) is no such case.
    again = localllm(daemon, "ps", LOCALLLM_DEFAULT_MODEL="smollm2")
    assert "note:" not in again.stderr, again.stderr
