"""The runner: the engine's one child program.

    python -m localllm.engine.runner

The messages are in protocol.py, and the first line names the program's op. The load (the
daemon's `Load`, one value) is answered by `Loaded`; then two threads: one reads commands from
stdin (a cancel takes effect at once, between two decode steps), the main thread runs the
engine's loop. Closing stdin ends the runner once what is in flight has finished or been
cancelled. A tuner's op (a dry run, a measurement...: tuner_ops.py) is answered alone, with its
typed result, and the program ends.

llama.cpp writes its logs to file descriptors 1 and 2, so the protocol gets a private copy of
stdout and fd 1 is pointed at stderr before the library loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time
import traceback

from ..cpu import amx_hazard
from .protocol import OP_BY_NAME, Failure, Loaded, TokenCoalescer, event_to_wire

log = logging.getLogger("localllm.runner")
LOAD = OP_BY_NAME["load"]  # the first line's op


class Channel:
    def __init__(self):
        self._out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        self._lock = threading.Lock()

    def send(self, message: dict) -> None:
        line = json.dumps(message, ensure_ascii=False)
        with self._lock:
            self._out.write(line + "\n")


def read_commands(engine, channel: Channel) -> None:
    """stdin -> the engine, by the op table (protocol.OPS); "cancel" sets a request's flag. A
    line that does not parse means the daemon and the runner no longer understand each other:
    stop taking work (fail closed)."""
    flags: dict[str, threading.Event] = {}
    for line in sys.stdin:
        try:
            message = json.loads(line)
            op = message["op"]
            request_id = message["id"]
        except (ValueError, KeyError, TypeError):
            log.error("unreadable command from the daemon: %.200r; stopping", line)
            break
        if op == "cancel":
            flag = flags.get(request_id)
            if flag is not None:
                flag.set()
            continue
        send = (lambda event, rid=request_id: channel.send(event_to_wire(rid, event)))
        kind = OP_BY_NAME.get(op)
        if kind is None or kind is LOAD or kind.alone:
            log.error("%s op %r; stopping", "a first-line" if kind else "unknown", op)
            break
        try:
            request = kind.request.from_wire(message)
        except (TypeError, ValueError, KeyError) as e:
            send(Failure(f"malformed request: {e}", status=400))
            continue
        serve = getattr(engine, kind.method)
        if not kind.stream:
            engine.ask(lambda serve=serve, request=request: serve(request), send)
            continue
        flag = flags[request_id] = threading.Event()
        serve(request, TokenCoalescer(send, on_end=lambda rid=request_id: flags.pop(rid, None)),
              flag)
    for flag in list(flags.values()):
        flag.set()  # the daemon is gone or wants us gone: nothing is waiting for answers
    engine.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="runner %(process)d %(levelname)s %(message)s")
    channel = Channel()
    first = sys.stdin.readline()
    if not first:
        return 0
    try:
        message = json.loads(first)
        kind = OP_BY_NAME[message["op"]]
    except (ValueError, KeyError, TypeError):
        kind = None
    if kind is None or not (kind is LOAD or kind.alone):
        channel.send(event_to_wire("", Failure(
            f"not an op a runner starts with: {first[:80]!r}", status=400)))
        return 2
    if kind.alone:
        from .tuner_ops import answer

        return answer(kind, message, channel.send)
    # The CUDA build of llama.cpp must be loaded before numpy: the other order segfaults at
    # model load (seen on an H200). Plan, the engine and gguf all pull numpy in.
    import llama_cpp  # noqa: F401
    try:
        load = LOAD.request.from_wire(message)
        hazard = amx_hazard() if load.plan.extra_bufts else ""
        if hazard:  # ggml's AMX kernels would crash on this CPU: the plan goes without them
            log.warning("%s", hazard)
            load = dataclasses.replace(load, plan=dataclasses.replace(
                load.plan, extra_bufts=False), bands=tuple(
                dataclasses.replace(b, extra_bufts=False) for b in load.bands))

        from .engine import RunnerEngine

        t0 = time.perf_counter_ns()
        engine = getattr(RunnerEngine, LOAD.method)(load)
        load_ns = time.perf_counter_ns() - t0
    except Exception as e:  # any load failure is reported, then the runner exits
        log.error("load failed: %s", traceback.format_exc())
        channel.send(event_to_wire("", Failure(str(e) or type(e).__name__)))
        return 1
    engine.steps.on_threads = lambda event: channel.send(event_to_wire("", event))
    engine.bands.on_band = lambda event: channel.send(event_to_wire("", event))
    resident = engine.lm.resident
    pool = engine.model.expert_cache_stats()  # None: the plan asked none, or the engine refused
    # after each answer where any band's plan asks a pool (a context without one sends
    # nothing); a load whose plans ask none reads no pool's figures
    if any(plan.expert_cache for plan in engine.bands.plans):
        engine.replies.on_expert_cache = lambda event: channel.send(event_to_wire("", event))
    channel.send(event_to_wire("", Loaded(
        os.getpid(), load_ns, engine.n_ctx, len(engine.slots), engine.lm.weights_in_ram,
        dataclasses.asdict(pool) if pool else None, resident.report() if resident else None,
        hazard)))
    log.info("loaded %s with %d slots of %d tokens", load.model_path, len(engine.slots),
             engine.n_ctx)
    threading.Thread(target=read_commands, args=(engine, channel), daemon=True).start()
    try:
        engine.run()
    finally:
        log.info("runner ends after %d tokens", engine.tokens_generated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
