"""The daemon's handle on one runner process: start it, send requests, read events, kill it.

Fails closed: a runner that dies (crash, OOM kill, abort inside llama.cpp), writes a line that
does not parse, or goes silent while answering is killed, every request in flight ends with a
Failure that says why, and `alive` turns false so the scheduler loads the model again on the
next request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from pathlib import Path

from localllm.engine.cpu import describe_crash, is_engine_crash
from localllm.engine.expert_cache import ExpertCacheStats
from localllm.engine.runner.load import Load
from localllm.engine.runner.protocol import (
    ENDING_EVENTS,
    RUNNER_COMMAND,
    RUNNER_SILENCE_S,
    Band,
    CpuShare,
    Done,
    Embeddings,
    EmbedRequest,
    Event,
    Failure,
    GenerationRequest,
    Loaded,
    Request,
    Threads,
    Token,
    TokenizeRequest,
    event_from_wire,
    new_request_id,
)
from localllm.planner.plan import Plan

from localllm.errors import UserError
from localllm.paths import LOG_FILE_BACKUPS, LOG_FILE_BYTES, open_private_log
from localllm.speculative import SPECULATIVE_CHOICES

log = logging.getLogger("localllm.runner.process")
# Protocol lines can be long (a Done event carries the whole token context).
STREAM_LIMIT = 64 * 1024 * 1024


def runner_env(plan: Plan) -> dict[str, str]:
    """The runner's environment: the daemon's, with the plan's GPUs as CUDA_VISIBLE_DEVICES in
    NVML's (PCI bus) order, so that CUDA0, CUDA1... are the GPUs the plan was made for. (The
    expert cache is the plan's alone: engine/expert_cache.py gives the engine its settings.)"""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if plan.gpus:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in plan.gpus)
    return env


class LoadError(UserError):
    """The runner could not load the model (message from llama.cpp, or how it died).
    `refused`: llama.cpp said no (out of VRAM, as a rule, where a smaller plan may load);
    otherwise the runner died or hung, where a plan with less on the GPU would not help (a
    process the kernel killed for RAM would only need more of it)."""

    status = 500

    def __init__(self, message: str, refused: bool = False):
        super().__init__(message)
        self.refused = refused


class EngineCrashed(LoadError):
    """The engine died of a crash signal (SIGSEGV, SIGILL...) while loading or at its self-check
    decode: a kernel that is wrong on this CPU, where the same plan crashes again but one
    without llama.cpp's extra buffer types may not (daemon/scheduler.py)."""


class RunnerRequestFailed(UserError):
    """The runner answered a tokenize or embed request with a Failure (status from it)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.status = failure.status


class RunnerProcess:  # the local model's Engine (engine/seam.py)
    def __init__(self, model_name: str, model_path: Path, plan: Plan, log_path: Path,
                 command: Sequence[str] = RUNNER_COMMAND, draft_model_path: Path | None = None,
                 projector_path: Path | None = None, prompt_cache_bytes: int = 0,
                 bands: tuple[Plan, ...] = (), start_band: int = 0):
        """`bands`: plans for smaller contexts than `plan`'s, smallest first (fill bands): the
        runner starts in `start_band` (len(bands): the whole plan) and moves up as sequences
        grow (engine.py)."""
        self.model_name = model_name
        self.projector_path = projector_path
        self.model_path = model_path
        self.plan = plan  # the whole context's: what the load was asked for
        # what crosses the pipe, one value (the scheduler's load, as started: starting.py)
        self.load = Load(plan, bands=tuple(bands), start_band=start_band,
                         draft_path=draft_model_path, projector=projector_path,
                         prompt_cache_bytes=prompt_cache_bytes, model_path=model_path)
        # decided at start: what each `speculative` a request may say runs as (Plan.request_mode)
        self.request_modes = {name: plan.request_mode(name) for name in SPECULATIVE_CHOICES}
        self.bands = tuple(bands)
        self.band = start_band  # the band whose plan runs now (index into bands + (plan,))
        self.band_pauses: list[float] = []  # seconds each band switch stopped decoding
        self.log_path = log_path
        self.command = tuple(command)
        self.proc: asyncio.subprocess.Process | None = None
        self.load_duration_ns = 0
        self.n_ctx = plan.n_ctx
        self.n_parallel = plan.n_parallel
        self.past_ram: dict | None = None
        self.n_threads = plan.n_threads  # decode threads in use (the runner may drop some)
        self.threads_reason = ""  # why they differ from the plan's
        self.cpu_share = 1  # the runners computing on the CPU at once that it was told of
        self.loaded_at = 0.0
        self.last_done: Done | None = None
        # The expert cache's figures as of the last answer (None: the model has no pool)
        self.expert_cache: ExpertCacheStats | None = None
        self.weights_in_ram = ""
        self.tokens_generated = 0  # every token the runner produced, cancelled ones included
        self._events: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._exit_reason = ""
        self._stopping = False  # stop() was called: an exit now is the one asked for
        # Called with (mode, drafted, accepted) after each answer that drafted.
        self.on_drafts: Callable[[str, int, int], None] | None = None
        self.on_done: Callable[[Done], None] | None = None  # after each answer
        # Called with (the plan that ran, why, its exit code) when the runner ends without
        # being asked to; the code is None where the daemon ended it (hung, unreadable)
        self.on_death: Callable[[Plan, str, int | None], None] | None = None

    @property
    def running_plan(self) -> Plan:
        """The plan of the fill band the runner is in now (the whole plan without bands)."""
        plans = (*self.bands, self.plan)
        return plans[min(self.band, len(plans) - 1)]

    def fill_band(self) -> dict:
        """For ps and stats: the band the runner is in, its bands and each switch's pause."""
        return {"n_ctx": self.running_plan.n_ctx,
                "bands": [b.n_ctx for b in (*self.bands, self.plan)],
                "switch_pauses": [round(p, 3) for p in self.band_pauses]}

    @classmethod
    def of(cls, name: str, load: Load, log_path: Path, command: Sequence[str]) -> RunnerProcess:
        """The runner of the scheduler's `load` (its model_path set), which crosses as it is."""
        runner = cls(name, load.model_path, load.plan, log_path, command, load.draft_path,
                     load.projector, load.prompt_cache_bytes, load.bands, load.start_band)
        runner.load = load
        return runner

    def figures(self) -> dict:
        """What the runner has done since its load (the Engine's figures, engine/seam.py)."""
        return {"loaded_at": self.loaded_at, "load_duration": self.load_duration_ns,
                "context_length": self.n_ctx, "tokens_generated": self.tokens_generated}

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None and not self._exit_reason

    async def start(self, timeout: float | None = None) -> None:
        # llama.cpp's own log goes here: rotated past a size at each start, the user's alone
        with open_private_log(self.log_path, LOG_FILE_BYTES, LOG_FILE_BACKUPS) as stderr:
            self.proc = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                limit=STREAM_LIMIT, env=runner_env(self.plan),
            )
        self._send(self.load.to_wire())
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self._release()
            raise LoadError(f"loading {self.model_name} took longer than {timeout:.0f}s; the "
                            f"runner was stopped (see {self.log_path}; config load_timeout)"
                            ) from None
        if not line:
            raise exit_while_loading(self.model_name, await self._release(), self.plan,
                                     self.log_path)
        try:
            loaded = event_from_wire(json.loads(line))
        except (ValueError, TypeError, KeyError, AttributeError):
            loaded = Failure(f"unreadable answer {line[:200]!r}")
        if not isinstance(loaded, Loaded):
            self.proc.kill()
            await self._release()
            raise LoadError(f"cannot load {self.model_name}: {getattr(loaded, 'message', '')}",
                            refused=True)
        self.load_duration_ns, self.n_ctx = loaded.load_duration_ns, loaded.n_ctx
        self.n_parallel, self.past_ram = loaded.n_parallel, loaded.past_ram
        # what really holds the weights in RAM (engine/model.py), which a refused pin changes
        self.weights_in_ram = loaded.weights_in_ram
        if loaded.expert_cache:
            self.expert_cache = ExpertCacheStats(**loaded.expert_cache)
        warn_of_refusals(self.model_name, self.running_plan, loaded, self.log_path)  # its band
        self.plan, self.bands = as_loaded(self.model_name, self.plan, self.bands, loaded)
        if self.past_ram:
            log.info("runner for %s, past RAM: %s", self.model_name, self.past_ram["text"])
        self.loaded_at = time.time()
        self._reader = asyncio.create_task(self._read_events())

    def _send(self, message: dict) -> None:
        assert self.proc and self.proc.stdin
        if self.proc.stdin.is_closing():
            return
        self.proc.stdin.write((json.dumps(message) + "\n").encode())

    async def _read_events(self) -> None:
        assert self.proc and self.proc.stdout
        why = ""
        try:
            while line := await self.proc.stdout.readline():
                data = json.loads(line)
                queue = self._events.get(data.get("id", ""))
                event = event_from_wire(data)
                if isinstance(event, Threads):  # on its own, or a CpuShare's answer
                    self.n_threads, self.threads_reason = event.n_threads, event.reason
                    log.info("runner for %s: %s", self.model_name, event.reason)
                    if queue is None:
                        continue
                if isinstance(event, ExpertCacheStats):
                    self.expert_cache = event
                    continue
                if isinstance(event, Band):  # its pool, if any, reports after an answer
                    self.band, self.expert_cache = event.band, None
                    self.band_pauses.append(event.pause_s)
                    log.info("runner for %s: %s", self.model_name, event.reason)
                    continue
                if isinstance(event, Token):
                    self.tokens_generated += event.n_tokens
                if queue is not None:
                    queue.put_nowait(event)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            why = f"it sent an unreadable message ({type(e).__name__}: {e})"
            log.error("runner for %s (pid %s): %s; stopping it", self.model_name, self.pid, why)
            self.proc.kill()
        code = await self.proc.wait()
        if not why and is_engine_crash(code):
            why = f"{describe_exit(code)}: {describe_crash(code, extra_bufts=False)}"
        self._fail_all(why or describe_exit(code), None if why else code)

    def _fail_all(self, why: str, code: int | None = None) -> None:
        """The runner is gone or no longer trusted: end every request in flight."""
        if not self._exit_reason:
            self._exit_reason = why
            # An unload (idle, a reload, shutdown) ends the runner on purpose: info, not a
            # warning, unless it cut answers short.
            asked = self._stopping and not self._events
            log.log(logging.INFO if asked else logging.WARNING, "runner for %s (pid %s) %s: %s",
                    self.model_name, self.pid, "stopped" if asked else "ended", why)
            if not self._stopping and self.on_death is not None:
                self.on_death(self.running_plan, why, code)
        for queue in self._events.values():  # 503: asking again loads it afresh
            queue.put_nowait(Failure(
                f"the runner for {self.model_name} stopped mid-answer ({self._exit_reason}); "
                f"the next request will load it again", status=503))

    async def _next(self, queue: asyncio.Queue, silence_s: float) -> Event:
        """The next event, or a Failure when the runner says nothing for `silence_s` while
        serving (prompt chunks send progress, so a working runner is never silent long)."""
        try:
            return await asyncio.wait_for(queue.get(), silence_s)
        except TimeoutError:
            if self.proc and self.proc.returncode is None:
                self.proc.kill()
            self._fail_all(f"no answer for {silence_s:.0f}s")
            return queue.get_nowait()

    async def generate(self, request: GenerationRequest,
                       silence_s: float = RUNNER_SILENCE_S) -> AsyncIterator[Event]:
        """Events of one request; cancels it in the runner if the consumer stops early. The
        request's `auto` drafting is the plan's mode here: the runner sees no `auto`."""
        mode = self.request_modes.get(request.options.speculative, request.options.speculative)
        request = replace(request, options=replace(request.options, speculative=mode))
        async for event in self._exchange(request.id, request.to_wire(), silence_s):
            if isinstance(event, Done) and event.drafted and self.on_drafts is not None:
                self.on_drafts(mode, event.drafted, event.draft_accepted or 0)
            if isinstance(event, Done) and self.on_done is not None:
                self.on_done(event)
            yield event

    async def ask(self, request: Request, silence_s: float = RUNNER_SILENCE_S) -> Event:
        """A request with one answer (an op of protocol.OPS that does not stream): that
        answer, else RunnerRequestFailed."""
        async for event in self._exchange(request.id, request.to_wire(), silence_s):
            if isinstance(event, Failure):
                raise RunnerRequestFailed(event)
            return event
        raise RunnerRequestFailed(Failure("the runner ended the request without an answer"))

    async def share_cpu(self, runners: int) -> None:
        """Tell the runner how many runners compute on the CPU at once (itself among them)."""
        if runners == self.cpu_share or not self.alive:
            return
        self.cpu_share = runners
        with contextlib.suppress(RunnerRequestFailed):  # it died: its requests hear of it
            await self.ask(CpuShare(new_request_id(), runners))

    async def embed(self, request: EmbedRequest, silence_s=RUNNER_SILENCE_S) -> Embeddings:
        return await self.ask(request, silence_s)

    async def count_tokens(self, text: str, silence_s: float = RUNNER_SILENCE_S) -> int:
        """Tokens `text` is as a raw prompt (special tokens parsed, BOS as the model adds it)."""
        event = await self.ask(TokenizeRequest(new_request_id(), text=text), silence_s)
        return event.count

    async def count_tokens_each(self, texts: list[str],
                                silence_s: float = RUNNER_SILENCE_S) -> list[int]:
        """Each text's tokens (no BOS), in one round trip (truncation counts turns so)."""
        event = await self.ask(TokenizeRequest(new_request_id(), texts=tuple(texts)),
                               silence_s)
        return list(event.counts)

    async def _exchange(self, request_id: str, message: dict,
                        silence_s: float) -> AsyncIterator[Event]:
        if not self.alive:
            yield Failure(f"the runner for {self.model_name} is not running", status=500)
            return
        queue: asyncio.Queue = asyncio.Queue()
        self._events[request_id] = queue
        finished = False
        try:
            self._send(message)
            while True:
                event = await self._next(queue, silence_s)
                if isinstance(event, ENDING_EVENTS):
                    finished = True  # before yielding: the consumer may stop at this event
                    if isinstance(event, Done):
                        self.last_done = event
                    yield event
                    return
                yield event
        finally:
            if not finished and self.alive:
                self._send({"op": "cancel", "id": request_id})
                with contextlib.suppress(TimeoutError):
                    # The runner ends the request at its next step; wait so the slot is free
                    # before this request's place is given to the next one.
                    await asyncio.wait_for(self._drain(queue), silence_s)
            self._events.pop(request_id, None)

    async def _drain(self, queue: asyncio.Queue) -> None:
        while True:
            event = await queue.get()
            if isinstance(event, ENDING_EVENTS):
                if isinstance(event, Done):
                    self.last_done = event
                return

    async def stop(self) -> None:
        if not self.proc:
            return
        self._stopping = True
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


def warn_of_refusals(model_name: str, plan: Plan, loaded: Loaded, log_path: Path) -> None:
    """Log what the plan asked that the runner's Loaded says did not happen."""
    if plan.pin_in_place and loaded.weights_in_ram != "pinned in place":
        log.warning("runner for %s: the plan pins the weights in RAM in place and the driver "
                    "refused: they were copied into pinned memory instead (see %s)",
                    model_name, log_path)
    cache = loaded.expert_cache
    if plan.expert_cache and not cache:
        log.warning("runner for %s: the plan asked an expert cache of %d slots and llama.cpp "
                    "made none (see %s)", model_name, plan.expert_cache, log_path)
    elif plan.expert_misses_on_gpu and cache and not cache.get("misses_on_gpu"):
        log.warning("runner for %s: the plan asked the GPU to compute the expert cache's misses "
                    "and llama.cpp leaves them to the CPU (see %s)", model_name, log_path)


def as_loaded(model_name: str, plan: Plan, bands: tuple[Plan, ...],
              loaded: Loaded) -> tuple[Plan, tuple[Plan, ...]]:
    """The plan and bands as the runner loaded them, for ps: without llama.cpp's extra buffer
    types where it left them off, the reason among plan_reasons."""
    why = loaded.extra_bufts_off
    if not why:
        return plan, bands
    log.warning("runner for %s: %s", model_name, why)

    def off(p: Plan) -> Plan:
        return replace(p, extra_bufts=False, reasons=(*p.reasons, why))

    return off(plan), tuple(off(b) for b in bands)


def exit_while_loading(model_name: str, code: int | None, plan: Plan,
                       log_path: Path) -> LoadError:
    """The error for a runner that exited before it said it had loaded."""
    if is_engine_crash(code):
        return EngineCrashed(f"the runner crashed while loading {model_name}: "
                             f"{describe_crash(code, plan.extra_bufts)}; see {log_path}")
    # SIGKILL that no one here sent, while weights are read: the kernel's OOM killer
    oom = (" - most likely out of memory: the kernel kills a process that outgrows RAM "
           "or its cgroup's limit; a smaller ram_budget or context plans for less"
           if code == -signal.SIGKILL else "")
    return LoadError(f"the runner exited while loading {model_name} "
                     f"({describe_exit(code)}{oom}); see {log_path}")


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
