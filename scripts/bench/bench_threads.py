"""Decode speed beside a CPU hog: the plan's fixed threads vs the runner's adaptive ones.

    .venv/bin/python -m scripts.bench.bench_threads                  SmolLM2 (the test model)
    .venv/bin/python -m scripts.bench.bench_threads --model M.gguf --seconds 10 --rounds 5 --hogs 1

Two engines of the same plan (the tuner's for this machine, one slot) are loaded side by side,
one with `adapt_threads=False` (what the runner did before threads.py), one adaptive. Each
round decodes greedily for `--seconds` on each, in turn, first with the host as it is, then
with `--hogs` busy-loop processes started by this script (killed at the end). Figures are
tokens per second of decode (after the first token), the median over the rounds, and the
threads each engine ended the round with. Other processes on the machine count as load too:
say what else ran when quoting the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import replace
from pathlib import Path


HOG = "import time\nend = time.monotonic() + 900\nwhile time.monotonic() < end: pass\n"
PROMPT = "1, 2, 3, 4, 5, 6, 7, 8,"  # greedy counting goes on for thousands of tokens


def decode(engine, seconds: float, protocol) -> float:
    """Tokens per second of one greedy answer, cancelled after `seconds` of decode."""
    first = threading.Event()
    done = threading.Event()
    cancelled = threading.Event()
    counted = {"tokens": 0, "start": 0.0}

    def emit(event) -> None:
        if isinstance(event, protocol.Token):
            if not first.is_set():
                counted["start"] = time.perf_counter()
                first.set()
            else:
                counted["tokens"] += event.n_tokens
        elif isinstance(event, protocol.Failure):
            print(f"the engine failed the request: {event.message}", file=sys.stderr)
            os._exit(1)
        elif isinstance(event, protocol.Done):  # cancelled, or the model stopped early
            counted["end"] = time.perf_counter()
            first.set()
            done.set()

    options = protocol.SamplingOptions(temperature=0, num_predict=100_000)
    engine.submit(protocol.GenerationRequest(id=uuid.uuid4().hex[:12], prompt=PROMPT,
                                             options=options), emit, cancelled)
    if not first.wait(900):  # a crowded host can take minutes to read even a short prompt
        raise SystemExit("no first token in 900 s")
    done.wait(seconds)  # the measured decode (a benchmark, not a test)
    cancelled.set()
    done.wait(300)
    if not counted["start"]:
        raise SystemExit("the model ended its answer before its first token")
    return counted["tokens"] / max(counted["end"] - counted["start"], 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a GGUF (default: the SmolLM2 test model)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=1, help="busy-loop processes (cores)")
    args = parser.parse_args()

    import llama_cpp  # noqa: F401  (before numpy: see localllm/engine/runner/__main__.py)
    from localllm.engine.hardware import probe_card
    from localllm.engine.runner import protocol
    from localllm.engine.runner.engine import RunnerEngine
    from localllm.modelstore.shape import read_shape
    from localllm.profiles.choose import choose_plan

    from localllm.options import LoadOptions

    if args.model is None:
        from scripts import fetch_test_models

        args.model = fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")
    plan = replace(choose_plan(read_shape(args.model), "bench-threads", None, LoadOptions(),
                               probe_card()),
                   n_parallel=1)
    print(f"model {args.model.name}: plan {plan.n_threads} threads, predicted decode "
          f"{plan.predicted_decode_tps:.1f} tok/s; {args.seconds:.0f} s per run, "
          f"{args.rounds} rounds, {args.hogs} hog(s)")
    engines = {"fixed": RunnerEngine(str(args.model), plan, adapt_threads=False),
               "adaptive": RunnerEngine(str(args.model), plan)}
    for engine in engines.values():
        threading.Thread(target=engine.run, daemon=True).start()

    results: dict[tuple[str, str], list[float]] = {}
    threads: dict[tuple[str, str], list[int]] = {}
    hogs: list[subprocess.Popen] = []
    try:
        for load in ("host as it is", f"{args.hogs} hog(s)"):
            if load != "host as it is":
                hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)]
            for r in range(args.rounds):
                for name, engine in engines.items():
                    tps = decode(engine, args.seconds, protocol)
                    results.setdefault((load, name), []).append(tps)
                    threads.setdefault((load, name), []).append(engine.n_threads)
                    print(f"  {load:<14} round {r + 1} {name:<9} {tps:7.1f} tok/s "
                          f"({engine.n_threads} threads after)", flush=True)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print()
    print("| load | fixed threads tok/s (median) | adaptive tok/s (median) | adaptive/fixed | "
          "adaptive threads |")
    print("| --- | --- | --- | --- | --- |")
    for load in ("host as it is", f"{args.hogs} hog(s)"):
        fixed = statistics.median(results[(load, "fixed")])
        adaptive = statistics.median(results[(load, "adaptive")])
        print(f"| {load} | {fixed:.1f} | {adaptive:.1f} | {adaptive / max(fixed, 1e-9):.1f}x | "
              f"{threads[(load, 'adaptive')]} |")
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
