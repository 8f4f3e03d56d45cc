"""The tuner's ops in the runner program (protocol.OPS rows marked `alone`): a dry run, a
measurement, an evaluation, an RPC probe, a bandwidth calibration, ggml's CPU kernels timed,
each the first and only line a runner reads, answered with its typed result; then the program ends.

Each runs in a process of its own and ends with it: a dry run or a measurement creates a CUDA
context the daemon must not hold, ggml-rpc aborts the process when a worker goes away and a
worker serves one client until it disconnects, and torch's CUDA runtime must not share a process
with llama.cpp's (a process holding both aborted in free()). So each op imports only what it
uses: the calibration never loads llama.cpp, and the llama.cpp ops load it before anything that
imports numpy (with a CUDA build, numpy loaded first crashes the model load).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from localllm.engine.probes import (
    Calibrate,
    Chunks,
    DryRun,
    Evaluate,
    KernelRates,
    Measure,
    RpcProbe,
    TimeKernels,
)

from localllm.errors import UserError

from .protocol import Failure, Op, event_to_wire

log = logging.getLogger("localllm.runner")


def dry_run(request: DryRun, emit: Callable) -> object:
    from localllm.engine.dryrun import run

    return run(request.model_path, request.plan)


def measure(request: Measure, emit: Callable) -> object:
    from localllm.engine.measure import run

    return run(request)


def evaluate(request: Evaluate, emit: Callable) -> object:
    from localllm.engine.evaluate import run

    return run(request, lambda done, total: emit(Chunks(done, total)))


def rpc_probe(request: RpcProbe, emit: Callable) -> object:
    from localllm.engine.rpc import probe

    return probe(request.endpoints)


def calibrate(request: Calibrate, emit: Callable) -> object:
    from localllm.engine.bandwidth import measure_bandwidth  # torch, never llama.cpp

    return measure_bandwidth(request.device)


def time_kernels(request: TimeKernels, emit: Callable) -> object:
    from localllm.engine.kernel_rates import measure_kernel_gbs  # ggml's CPU library only

    rates = measure_kernel_gbs(list(request.types), list(request.threads), request.buffer_bytes)
    return KernelRates(tuple((name, n, gbs) for name, by_threads in rates.items()
                             for n, gbs in by_threads.items()))


# what each `alone` op's `method` names
METHODS = {f.__name__: f for f in (dry_run, measure, evaluate, rpc_probe, calibrate,
                                   time_kernels)}


def answer(op: Op, message: dict, send: Callable[[dict], None]) -> int:
    """Serve `op` (an `alone` op) for its first line `message`: its result, or a Failure (400
    for a request that misses what it needs or that the user can fix, else 500). The exit
    status: 0 answered, 2 unreadable, 1 failed."""
    def emit(event) -> None:
        send(event_to_wire("", event))

    try:
        request = op.request.from_wire(message)
    except (KeyError, TypeError, ValueError) as e:
        emit(Failure(f"a {op.name} request without what it needs: {e}", status=400))
        return 2
    if not isinstance(request, Calibrate):
        import llama_cpp  # noqa: F401  (first: see the module doc; also the ggml libraries' folder)
    try:
        result = METHODS[op.method](request, emit)
    except UserError as e:
        emit(Failure(str(e), status=400))
        return 1
    except Exception as e:  # a bug or llama.cpp's refusal: its trace for the log, a line back
        log.exception("%s failed", op.name)
        emit(Failure(f"{type(e).__name__}: {e}"))
        return 1
    emit(result)
    return 0
