"""The engine's one child program for the tuner (`python -m localllm.llama.probe`): one request
on stdin, an op of profiles/planning/probes.py (a dry run, a measurement, an evaluation, an RPC
probe, a bandwidth calibration), answered with its typed result as the last line on stdout.

Each op runs in a process of its own and ends with it: a dry run or a measurement creates a
CUDA context the daemon must not hold, ggml-rpc aborts the process when a worker goes away and a
worker serves one client until it disconnects, and torch's CUDA runtime must not share a process
with llama.cpp's (a process holding both aborted in free()). So each op imports only what it
uses: the calibration never loads llama.cpp, and the llama.cpp ops load it before anything that
imports numpy (with a CUDA build, numpy loaded first crashes the model load).
"""

from __future__ import annotations

import sys
import traceback

from localllm.errors import UserError
from localllm.profiles.planning.probes import (
    Calibrate,
    DryRun,
    Evaluate,
    Measure,
    ProbeRequest,
    RpcProbe,
    progress_line,
    read_request,
    result_line,
)


def _progress(done: int, total: int) -> None:
    print(progress_line(done, total), flush=True)


def answer(request: ProbeRequest):
    """The op's typed result, computed in this process."""
    if isinstance(request, Calibrate):
        from .bandwidth import measure_bandwidth

        return measure_bandwidth(request.device)
    import llama_cpp  # noqa: F401  (first: see the module doc; also the ggml libraries' folder)

    if isinstance(request, DryRun):
        from .dryrun import run as dry_run

        return dry_run(request.model_path, request.plan)
    if isinstance(request, Measure):
        from .measure import run as measure

        return measure(request)
    if isinstance(request, Evaluate):
        from .evaluate import run as evaluate

        return evaluate(request, _progress)
    if isinstance(request, RpcProbe):
        from .rpc import probe

        return probe(request.endpoints)
    raise ValueError(f"no op for {type(request).__name__}")


def main() -> int:
    import json

    try:
        request = read_request(sys.stdin.readline())
    except ValueError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 2
    try:
        result = answer(request)
    except UserError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return 1
    except Exception as e:  # a bug or llama.cpp's refusal: its trace for the log, a line back
        traceback.print_exc()
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
        return 1
    print(result_line(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
