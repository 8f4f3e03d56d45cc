"""Runs one of the tuner's ops (engine/probes.py) in the engine's one child program,
the runner (`python -m localllm.engine.runner`, its op table in engine/runner/protocol.py), and
returns its typed result: the one place the tuning service starts a process that loads
llama.cpp (or torch), so no CUDA context, ggml-rpc abort or second CUDA runtime ever lands in the
daemon or the CLI.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import threading
from collections.abc import Callable

from localllm.engine.runner.protocol import (
    OP_OF_REQUEST,
    RUNNER_COMMAND,
    Chunks,
    Failure,
    event_from_wire,
    request_to_wire,
)

from localllm.errors import UserError

from .probes import ProbeRequest


class ProbeFailed(UserError):
    """The child answered with an error, died, or was stopped at its time limit."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def ask(request: ProbeRequest, timeout: float,
        on_progress: Callable[[int, int], None] | None = None):
    """`request`'s result (the type its row in protocol.OPS ends with), from a runner of its
    own. `on_progress(done, total)` hears the child's Chunks events as they come; ProbeFailed
    says why there is no result: the child's own Failure, else the last line of its stderr."""
    op = OP_OF_REQUEST[type(request)]
    with tempfile.TemporaryFile("w+") as stderr, subprocess.Popen(
            RUNNER_COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            text=True) as proc:
        try:
            proc.stdin.write(json.dumps(request_to_wire(request)) + "\n")
            proc.stdin.close()
        except BrokenPipeError:  # it died at start: its stderr says why
            with contextlib.suppress(OSError):
                proc.stdin.close()
        timed_out = threading.Event()
        timer = threading.Timer(timeout, lambda: (timed_out.set(), proc.kill()))
        timer.start()
        last = None
        try:
            for line in proc.stdout:  # progress events, then the answer
                try:
                    last = event_from_wire(json.loads(line))
                except (ValueError, TypeError, KeyError, AttributeError):
                    last = Failure(f"an unreadable answer {line[:200]!r}")
                    proc.kill()
                    break
                if isinstance(last, Chunks) and on_progress:
                    on_progress(last.done, last.total)
        finally:
            timer.cancel()
        code = proc.wait()
        stderr.seek(0)
        errors = stderr.read()
    if timed_out.is_set():
        raise ProbeFailed(f"it took longer than {timeout:.0f} s and was stopped", timed_out=True)
    if isinstance(last, Failure):
        raise ProbeFailed(last.message)
    if code != 0 or not isinstance(last, op.ends):
        lines = errors.strip().splitlines()
        raise ProbeFailed(lines[-1] if lines else f"the child exited with {code} and no answer")
    return last
