"""The daemon's handle on one runner process: start it, send requests, read events, kill it.

A runner that dies (crash, OOM kill, abort inside llama.cpp) only fails the request it was
serving; the scheduler sees `alive` turn false and loads the model again on the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from localllm.profiles.plan import Plan

from .protocol import (
    Done,
    EmbedRequest,
    Embeddings,
    Event,
    Failure,
    GenerationRequest,
    Token,
    TokenCount,
    event_from_wire,
)

log = logging.getLogger("localllm.runner.process")
# Protocol lines can be long (a Done event carries the whole token context).
STREAM_LIMIT = 64 * 1024 * 1024


class LoadError(Exception):
    """The runner could not load the model (message from llama.cpp, or how it died)."""


class RunnerRequestFailed(Exception):
    """The runner answered a tokenize or embed request with a Failure (status from it)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.status = failure.status


class RunnerProcess:
    def __init__(self, model_name: str, model_path: Path, plan: Plan, log_path: Path):
        self.model_name = model_name
        self.model_path = model_path
        self.plan = plan
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.load_duration_ns = 0
        self.n_ctx = plan.n_ctx
        self.loaded_at = 0.0
        self.busy = False
        self.last_done: Done | None = None
        self.tokens_generated = 0  # every token the runner produced, cancelled ones included
        self._events: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._exit_reason = ""

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self._exit_reason

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as stderr:  # llama.cpp's own log goes here
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "localllm.daemon.runner",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                limit=STREAM_LIMIT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self._send({"op": "load", "model_path": str(self.model_path),
                    "plan": self.plan.to_dict()})
        line = await self.proc.stdout.readline()
        if not line:
            code = await self._release()
            raise LoadError(f"the runner exited while loading {self.model_name} "
                            f"({describe_exit(code)}); see {self.log_path}")
        reply = json.loads(line)
        if reply.get("event") != "loaded":
            await self._release()
            raise LoadError(f"cannot load {self.model_name}: {reply.get('message')}")
        self.load_duration_ns = reply["load_duration_ns"]
        self.n_ctx = reply["n_ctx"]
        self.loaded_at = time.time()
        self._reader = asyncio.create_task(self._read_events())

    def _send(self, message: dict) -> None:
        assert self.proc and self.proc.stdin
        self.proc.stdin.write((json.dumps(message) + "\n").encode())

    async def _read_events(self) -> None:
        assert self.proc and self.proc.stdout
        while line := await self.proc.stdout.readline():
            data = json.loads(line)
            event_id = data.get("id", "")
            event = event_from_wire(data)
            if isinstance(event, Token):
                self.tokens_generated += event.n_tokens
            queue = self._events.get(event_id)
            if queue is not None:
                queue.put_nowait(event)
        code = await self.proc.wait()
        self._exit_reason = describe_exit(code)
        log.warning("runner for %s (pid %s) ended: %s", self.model_name, self.pid,
                    self._exit_reason)
        for queue in self._events.values():
            queue.put_nowait(Failure(
                f"the runner for {self.model_name} stopped mid-answer ({self._exit_reason}); "
                f"the next request will load it again", status=500))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Event]:
        """Events of one request; cancels it in the runner if the consumer stops early."""
        if not self.alive:
            yield Failure(f"the runner for {self.model_name} is not running", status=500)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._events[request.id] = queue
        self.busy = True
        finished = False
        try:
            self._send(request.to_wire())
            while True:
                event = await queue.get()
                if isinstance(event, (Done, Failure)):
                    finished = True  # before yielding: the consumer may stop at this event
                    if isinstance(event, Done):
                        self.last_done = event
                    yield event
                    return
                yield event
        finally:
            if not finished and self.alive:
                self._send({"op": "cancel", "id": request.id})
                await self._drain(queue)
            self._events.pop(request.id, None)
            self.busy = False

    async def _ask(self, message: dict, request_id: str) -> Event:
        """One request with one answer (tokenize, embed): the answer event or a Failure."""
        if not self.alive:
            return Failure(f"the runner for {self.model_name} is not running", status=500)
        queue: asyncio.Queue = asyncio.Queue()
        self._events[request_id] = queue
        self.busy = True
        try:
            self._send(message)
            return await queue.get()
        finally:
            self._events.pop(request_id, None)
            self.busy = False

    async def count_tokens(self, text: str) -> int:
        """How many tokens `text` is as a raw prompt (special tokens parsed, BOS as the model
        adds it); the chat layer measures prompts with it to drop turns that do not fit."""
        request_id = new_request_id()
        event = await self._ask({"op": "tokenize", "id": request_id, "text": text}, request_id)
        if isinstance(event, TokenCount):
            return event.count
        raise RunnerRequestFailed(event if isinstance(event, Failure) else
                                  Failure(f"unexpected answer to tokenize: {event}"))

    async def embed(self, request: EmbedRequest) -> Embeddings:
        event = await self._ask(request.to_wire(), request.id)
        if isinstance(event, Embeddings):
            return event
        raise RunnerRequestFailed(event if isinstance(event, Failure) else
                                  Failure(f"unexpected answer to embed: {event}"))

    async def _drain(self, queue: asyncio.Queue) -> None:
        """After a cancel, wait for the runner to end the request, so the next starts clean."""
        while True:
            event = await queue.get()
            if isinstance(event, (Done, Failure)):
                if isinstance(event, Done):
                    self.last_done = event
                return

    async def stop(self) -> None:
        if not self.proc:
            return
        if self.alive:
            for request_id in list(self._events):  # an answer in flight ends now, not later
                self._send({"op": "cancel", "id": request_id})
        try:
            await asyncio.wait_for(self._release(), timeout=10)
        except TimeoutError:
            self.proc.kill()
            await self._release()
        if self._reader:
            await self._reader

    async def _release(self) -> int:
        """Close our end of the runner's stdin and wait for the process to end.

        The pipe must be closed here, not left to asyncio: a write pipe whose reader died is
        closed later by a callback, by file descriptor number, and by then the number may
        belong to the next runner's stdin (seen: a reload after a failed load hung because
        its requests went nowhere)."""
        assert self.proc
        stdin = self.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        if stdin is not None:
            with contextlib.suppress(ConnectionError):
                await stdin.wait_closed()
        return await self.proc.wait()


def new_request_id() -> str:
    return uuid.uuid4().hex[:16]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
