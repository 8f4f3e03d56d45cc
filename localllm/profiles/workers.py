"""RPC workers as the planner sees them (`Worker`, engine/probes.py), measured by the
engine's child program: engine/rpc.py owns the ggml-rpc library, which aborts the process it runs
in when a worker cannot be reached, so it says HELLO to each worker first, from Python."""

from __future__ import annotations

from localllm.engine.probes import RpcProbe, Worker, WorkerError
from localllm.engine.probing import ProbeFailed, ask

PROBE_TIMEOUT_S = 60.0


def probe_workers(endpoints: list[str] | tuple[str, ...],
                  timeout: float = PROBE_TIMEOUT_S) -> list[Worker]:
    """Memory, link and compute speed of each worker; WorkerError says why not."""
    endpoints = tuple(endpoints)
    try:
        return list(ask(RpcProbe(endpoints), timeout).workers)
    except ProbeFailed as e:
        if e.timed_out:
            raise WorkerError(
                f"RPC workers {', '.join(endpoints)} did not answer within {timeout:.0f} s; a "
                f"worker serves one client at a time: is another model or program using it?"
            ) from None
        raise WorkerError(str(e)) from None
