#!/usr/bin/env python3
"""What the runner's decode loop costs beside llama.cpp's own calls, per answered token.

    python -m scripts.bench.step_overhead [--model FILE.gguf] [--tokens 256] [--profile]

The runner's engine (engine/runner/engine.py) runs in this process on one model, greedy, with
speculation off, and answers --tokens tokens --runs times. Every llama_decode and the time
between one call's end and the next one's start is the loop's own work: sampling, batch
filling, bookkeeping, detokenising, stop strings and events (the median gap, so that a gap
the OS's scheduler stretched does not count). On a GPU llama_decode returns before the
device finishes (the wait falls in the sample, which reads the logits), so part of the loop
runs while the device works; on a CPU every part of it adds to each token. `--profile` prints
the loop's hottest Python functions (cProfile of the engine's thread).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]




class Timed:
    """Wraps llama_decode: the nanoseconds in it, and the gaps between one call's end and the
    next one's start (the loop's own work, one gap per token while answering)."""

    def __init__(self, fn):
        self.fn, self.ns, self.calls = fn, 0, 0
        self.gaps: list[int] = []
        self._ended = 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter_ns()
        if self._ended:
            self.gaps.append(start - self._ended)
        try:
            return self.fn(*args, **kwargs)
        finally:
            self._ended = time.perf_counter_ns()
            self.ns += self._ended - start
            self.calls += 1

    def reset(self) -> None:
        self.ns = self.calls = self._ended = 0
        self.gaps.clear()


def answer(engine, tokens: int) -> tuple[int, int]:
    """One greedy answer of `tokens` tokens; (tokens answered, wall ns from first to last)."""
    from localllm.engine.runner.protocol import Done, GenerationRequest, Token

    from localllm.options import SamplingOptions

    done = threading.Event()
    times: list[int] = []

    def emit(event) -> None:
        if isinstance(event, Token):
            times.append(time.perf_counter_ns())
        elif isinstance(event, Done) or getattr(event, "error", None):
            done.set()

    options = SamplingOptions(temperature=0, num_predict=tokens, speculative="off", seed=1)
    engine.submit(GenerationRequest(id=f"r{time.monotonic_ns()}", prompt="Once upon a time",
                                    options=options), emit, threading.Event())
    if not done.wait(600):
        raise SystemExit("no answer within 10 minutes")
    return len(times), (times[-1] - times[0]) if len(times) > 1 else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / ".cache" / "test-models" /
                                          "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--gpu-layers", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)

    from localllm.engine.runner.engine import RunnerEngine
    from localllm.planner.plan import Plan

    plan = Plan(n_ctx=2048, n_gpu_layers=args.gpu_layers, n_threads=args.threads,
                n_threads_batch=args.threads, flash_attn=args.gpu_layers > 0)
    engine = RunnerEngine(args.model, plan, adapt_threads=False)
    decode = engine.model.decode = Timed(engine.model.decode)
    profiler = cProfile.Profile() if args.profile else None

    def loop() -> None:
        if profiler:
            profiler.enable()
        engine.run()
        if profiler:
            profiler.disable()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    answer(engine, 8)  # warm up
    per_token = []
    for _ in range(args.runs):
        decode.reset()
        n, wall = answer(engine, args.tokens)
        steps = max(1, n - 1)
        # the median gap: a gap the OS's scheduler stretched is no part of the loop's cost
        per_token.append((wall / steps / 1000, decode.ns / max(1, decode.calls) / 1000,
                          statistics.median(decode.gaps[2:] or [0]) / 1000))
    engine.close()
    thread.join(60)
    wall, dec, own = (statistics.median(x) for x in zip(*per_token, strict=True))
    print(f"{args.tokens} tokens x {args.runs}: {wall:.1f} us a token, llama_decode {dec:.1f} us, "
          f"between two llama_decode calls {own:.1f} us (median gap)")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
