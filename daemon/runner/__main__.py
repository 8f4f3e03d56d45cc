"""The runner process: one loaded model, driven over pipes by the daemon.

    python -m localllm.daemon.runner

Protocol: JSON lines. The daemon writes {"op": "load", "model_path", "plan"} first, then
{"op": "generate", ...GenerationRequest} and {"op": "cancel", "id"}; the runner answers
{"event": "loaded"|"token"|"done"|"error", ...}. Closing stdin ends the runner.

llama.cpp writes its logs to file descriptors 1 and 2, so the protocol gets a private copy of
stdout and fd 1 is pointed at stderr before the library loads.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import replace

from .protocol import (
    EmbedRequest,
    Failure,
    GenerationRequest,
    Token,
    TokenCount,
    event_to_wire,
)

log = logging.getLogger("localllm.runner")


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


class TokenCoalescer:
    """Sends Token events at most every EMIT_INTERVAL_S, merged; other events at once.

    A small model on a few cores makes 100+ tokens a second; one pipe line, one HTTP chunk and
    one client parse per token then take CPU from llama.cpp's own threads. Merging tokens that
    come faster than a screen refresh keeps the decode speed without making the stream jerky:
    a token waits at most one token's time, and the first one goes out at once.
    """

    EMIT_INTERVAL_S = 0.025

    def __init__(self, send):
        self.send = send
        self.pending = None
        self.last_sent = 0.0

    def __call__(self, event) -> None:
        if isinstance(event, Token):
            if self.pending is not None:
                logprobs = event.logprobs
                if self.pending.logprobs is not None:
                    logprobs = self.pending.logprobs + (event.logprobs or ())
                event = replace(event, text=self.pending.text + event.text,
                                n_tokens=self.pending.n_tokens + event.n_tokens,
                                logprobs=logprobs)
            now = time.monotonic()
            if now - self.last_sent >= self.EMIT_INTERVAL_S:
                self.send(event)
                self.pending, self.last_sent = None, now
            else:
                self.pending = event
            return
        if self.pending is not None:
            self.send(self.pending)
            self.pending = None
        self.send(event)


def answer_once(engine, message: dict):
    """A request with one answer: a token count or embeddings (or the Failure instead)."""
    from .embedding import EmbedInputError

    try:
        if message["op"] == "tokenize":
            return TokenCount(engine.count_tokens(message["text"]))
        return engine.embed(EmbedRequest.from_wire(message))
    except (EmbedInputError, ValueError) as e:  # too long, or a reranker asked to embed
        return Failure(str(e), status=400)
    except Exception as e:  # a llama.cpp error ends this request, not the runner
        log.error("%s %s failed: %s", message["op"], message["id"], traceback.format_exc())
        return Failure(f"{message['op']} failed: {e}")


def main() -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="runner %(process)d %(levelname)s %(message)s")
    channel = Channel()
    # The CUDA build of llama.cpp must be loaded before numpy: the other order segfaults at
    # model load (seen on an H200). Plan, the engine and gguf all pull numpy in.
    import llama_cpp  # noqa: F401
    first = sys.stdin.readline()
    if not first:
        return 0
    load = json.loads(first)
    try:
        from localllm.profiles.plan import Plan

        from .engine import Engine

        t0 = time.perf_counter_ns()
        engine = Engine(load["model_path"], Plan.from_dict(load["plan"]))
        load_ns = time.perf_counter_ns() - t0
    except Exception as e:  # any load failure is reported, then the runner exits
        log.error("load failed: %s", traceback.format_exc())
        channel.send({"event": "load_failed", "message": str(e) or type(e).__name__})
        return 1
    channel.send({"event": "loaded", "pid": os.getpid(), "load_duration_ns": load_ns,
                  "n_ctx": engine.n_ctx})
    log.info("loaded %s", load["model_path"])

    requests: queue.Queue = queue.Queue()
    cancel_flags: dict[str, threading.Event] = {}
    flags_lock = threading.Lock()

    def read_commands() -> None:
        for line in sys.stdin:
            message = json.loads(line)
            if message.get("op") == "cancel":
                with flags_lock:
                    flag = cancel_flags.get(message["id"])
                if flag:
                    flag.set()
            else:
                with flags_lock:
                    cancel_flags[message["id"]] = threading.Event()
                requests.put(message)
        requests.put(None)  # stdin closed: the daemon is gone or wants us gone

    threading.Thread(target=read_commands, daemon=True).start()

    while (message := requests.get()) is not None:
        if message.get("op") in ("tokenize", "embed"):
            channel.send(event_to_wire(message["id"], answer_once(engine, message)))
            with flags_lock:
                cancel_flags.pop(message["id"], None)
            continue
        request = GenerationRequest.from_wire(message)
        with flags_lock:
            cancelled = cancel_flags[request.id]
        emit = TokenCoalescer(lambda event, rid=request.id: channel.send(event_to_wire(rid, event)))
        try:
            engine.generate(request, cancelled, emit)
        except Exception as e:  # a llama.cpp error ends this request, not the runner
            log.error("request %s failed: %s", request.id, traceback.format_exc())
            emit(Failure(f"generation failed: {e}"))
        if cancelled.is_set():
            log.info("request %s cancelled after %d tokens in total", request.id,
                     engine.tokens_generated)
        with flags_lock:
            cancel_flags.pop(request.id, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
