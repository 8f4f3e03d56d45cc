"""Runs one op of profiles/planning/probes.py in the engine's child program (llama/probe.py) and
returns its typed result: the one place the tuning service starts a process that loads
llama.cpp (or torch), so no CUDA context, ggml-rpc abort or second CUDA runtime ever lands in the
daemon or the CLI.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable

from localllm.errors import UserError

from ..planning.probes import ProbeRequest, read_result, request_line

CHILD_COMMAND = (sys.executable, "-m", "localllm.llama.probe")


class ProbeFailed(UserError):
    """The child answered with an error, died, or was stopped at its time limit."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def ask(request: ProbeRequest, timeout: float,
        on_progress: Callable[[int, int], None] | None = None):
    """`request`'s result (its op's `result` type) from a child process. `on_progress(done,
    total)` hears the child's progress lines as they come; ProbeFailed says why there is no
    result: the child's own error line, else the last line of its stderr."""
    with tempfile.TemporaryFile("w+") as stderr, subprocess.Popen(
            CHILD_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            text=True) as proc:
        try:
            proc.stdin.write(request_line(request) + "\n")
            proc.stdin.close()
        except BrokenPipeError:  # it died at start: its stderr says why
            with contextlib.suppress(OSError):
                proc.stdin.close()
        timed_out = threading.Event()
        timer = threading.Timer(timeout, lambda: (timed_out.set(), proc.kill()))
        timer.start()
        last: dict | None = None
        try:
            for line in proc.stdout:  # progress lines, then the answer's; llama.cpp's own
                if not line.startswith("{"):  # prints are not ours
                    continue
                try:
                    last = json.loads(line)
                except ValueError:
                    continue
                if on_progress and "progress" in last:
                    on_progress(*last["progress"])
        finally:
            timer.cancel()
        code = proc.wait()
        stderr.seek(0)
        errors = stderr.read()
    if timed_out.is_set():
        raise ProbeFailed(f"it took longer than {timeout:.0f} s and was stopped", timed_out=True)
    if last is not None and "error" in last:
        raise ProbeFailed(last["error"])
    if code != 0 or last is None or "result" not in last:
        lines = errors.strip().splitlines()
        raise ProbeFailed(lines[-1] if lines else f"the child exited with {code} and no answer")
    return read_result(request, last)
