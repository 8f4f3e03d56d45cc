"""Which models are loaded, who may use them, and when they go away.

One runner process per loaded model, serving up to `n_parallel` requests at once (its slots);
more wait, first come first served, on that model's semaphore. Loading a model takes only that
model's lock, so requests to other loaded models go on meanwhile. `max_queue` bounds every
request that waits, for a slot or for a load; `queue_timeout` bounds how long.

A request whose load options differ from the loaded runner's (a new num_ctx) reloads it after
the answers in progress end. keep_alive follows Ollama: a duration after the last request, 0
unloads at once, negative keeps the model loaded until the daemon stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from localllm.engine import nvml
from localllm.engine.runner.load import Load
from localllm.engine.runner.protocol import RUNNER_COMMAND, Done
from localllm.modelstore.gguf_header import GGUFError
from localllm.modelstore.pull import model_file
from localllm.modelstore.shape import ModelShape, read_shape
from localllm.modelstore.store import DamagedModel, ModelEntry, ModelStore, projector_path
from localllm.planner.ways import after_measuring
from localllm.profiles.served import (
    MIN_CHECK_TOKENS, DecodeCheck, ServedRecords, drained, has_host_part,
)

from localllm.config import Config
from localllm.errors import UserError
from localllm.options import LoadOptions

from .drafting import check_speculation, draft_model

# Planner, context_to_ask and first_band are imported from here too (tests, callers).
from .planner import Planner, context_to_ask, first_band  # noqa: F401
from .replanning import MAX_REPLANS, Replanning, way_trial_allowed
from .starting import RunnerProcess, RunnerStarter

log = logging.getLogger("localllm.scheduler")
GPU = nvml.GpuMemory()  # the runners' memory on the GPU, read after answers (NVML)
# How long a model whose plan missed its price (LoadedRunner.replan) must sit idle before it is
# loaded again: a follow-up that comes sooner (an agent's next turn, a user's next question)
# is answered by the running plan at once; a re-plan inside one made it wait 9.8 s on the H100.
REPLAN_IDLE_S = 5.0


class QueueFull(UserError):
    """Too many requests are waiting, or one waited too long (status 503, Retry-After)."""

    status = 503


SERVED_REMEMBERED = 64  # distinct load options a loaded model remembers answering


@dataclass
class LoadedRunner:
    """A loaded model: its runner, who uses it and who waits, and when it expires."""
    runner: RunnerProcess
    entry: ModelEntry
    shape: ModelShape  # read once at load; /api/ps and /api/stats use it
    file_id: tuple  # (inode, size, mtime) of the model file when it was loaded
    load: Load  # the load decision it was started from
    slots: asyncio.Semaphore = field(init=False)
    active: int = 0  # requests holding a slot
    waiting: int = 0  # requests waiting for a slot
    keep_alive: float | None = 300.0  # seconds after the last request; None = forever
    expires_at: float | None = None  # wall-clock time; None while in use or kept forever
    last_used: float = 0.0
    # Whether this load serves a request's load options (Load.serves), decided once per load
    # and options (the load and its runner's plan never change while it is loaded): at load
    # for the options it was loaded for, so the requests that follow, asking the same, find it.
    served: dict[LoadOptions, bool] = field(init=False, default_factory=dict)
    # Why this load should be planned again ("": it serves as planned): its expert pool's
    # measured hit rate is far from the one the plan was priced with. The reaper loads it again
    # once it has been idle Scheduler.replan_idle_s, between requests: a follow-up that comes
    # sooner is answered by the running plan, never made to wait for a new one.
    replan: str = ""
    replan_now: bool = False  # idle long enough: the next _loaded loads it again
    decided: Load | None = None  # what that load is, once the re-plan decided it
    # Its decode as served against the running plan's prediction (profiles/served.py),
    # from answers that had the runner to themselves: `crowded` is set while another request
    # overlapped one since the model was last idle.
    speed: DecodeCheck | None = None
    # The same for the running plan's way (planner/ways.py), from answers at whatever threads
    # the runner decodes with: its thread trials (engine/runner/threads.py) are how that way
    # serves on this host, and a way whose trials never ended was never measured (lease F: an
    # unmeasured way ran eleven answers, the runner trying 15 of 16 threads after each)
    way_speed: DecodeCheck | None = None
    crowded: bool = False
    # /api/stats' price of the running plan at its pool's measured hits: (plan, pool figures,
    # curve), made again only when the plan (a band switch) or an answer's figures change, not
    # on every poll of a live display. The plan itself, not its id: a freed plan's id returns.
    priced_at_hits: tuple = ()

    def __post_init__(self) -> None:
        self.slots = asyncio.Semaphore(max(1, self.runner.n_parallel))
        self.serves(self.load.asked)

    def serves(self, asked: LoadOptions) -> bool:
        """Whether the loaded model serves a request's load options as it is (Load.serves)."""
        found = self.served.get(asked)
        if found is None:
            if len(self.served) >= SERVED_REMEMBERED:
                self.served.clear()  # clients that vary num_ctx at will: no growing memory
            found = self.served[asked] = self.load.serves(self.runner.plan, asked)
        return found

    @property
    def busy(self) -> bool:
        return self.active > 0

    @property
    def idle(self) -> bool:
        return self.active == 0 and self.waiting == 0

    def answered(self, records: ServedRecords, done: Done, setting: int | str, replans: int,
                 card: Callable) -> str:
        """After an answer: its records for the tuner, its decode added to the plan's check;
        why the model should be planned again once idle ("": it should not, one is due
        already, or this model was planned again `replans` times, the most it may be). A plan
        found off its price has the error laid on the price it belongs to (`card`: this
        machine's card as the planner sees it); a way `auto` weighed has what it decoded
        stored once it is measured, and another way is loaded while one is unmeasured or was
        measured faster (planner/ways.py)."""
        runner = self.runner
        records.answered(done.prompt_tokens, done.prompt_tokens - done.cached_tokens,
                         done.eval_count, runner.expert_cache)
        if runner.running_plan.n_gpu_layers:  # a GPU plan: what its runner holds there
            pid = runner.pid
            records.vram_served(runner.running_plan, lambda: (GPU.by_pid() or {}).get(pid),
                                card)
        off = self.check_speed(done)
        check, trial = self.way_speed, ""
        if check is not None and check.plan.ways and not check.way_measured and \
                check.tokens >= MIN_CHECK_TOKENS:
            check.way_measured = True
            trial = after_measuring(check.plan, records.way_measured(check))
        if self.replan:
            return ""
        if replans >= MAX_REPLANS:  # prices corrected enough: ways measured, at most
            return trial if way_trial_allowed(replans, 1 + len(self.load.bands)) else ""
        if why := records.replan_reason(runner.expert_cache, runner.running_plan, setting):
            return why
        if off:
            records.repriced(check, self.shape, card, runner.expert_cache)
        return trial or off

    def check_speed(self, done: Done) -> str:
        """Add an answer's decode to the check against the running plan; why the plan should
        be priced again ("": it should not, or its prices are not the host's to correct: every
        weight on the GPU)."""
        runner = self.runner
        plan = runner.running_plan
        if self.crowded or runner.cpu_share != 1 or done.drafted is not None:
            return ""  # not the plan's own decode: shared or drafted
        answer = (done.prompt_tokens, done.eval_count, done.eval_duration_ns / 1e9)
        if self.way_speed is None or self.way_speed.plan is not plan:
            self.way_speed = DecodeCheck(plan)
        self.way_speed.add(*answer)
        if runner.n_threads != plan.n_threads:
            return ""  # fewer threads than it was priced with: no price of the host's to correct
        if self.speed is None or self.speed.plan is not plan:
            # a new load, a fill band's other plan, or the same runner priced again
            self.speed = DecodeCheck(plan, on_host=has_host_part(plan, self.shape.n_layer))
        self.speed.add(*answer)
        return self.speed.off() if self.speed.on_host else ""


def file_id(path) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return ()
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class Scheduler(Replanning):
    def __init__(self, store: ModelStore, config: Config, log_dir,
                 planner: Planner | None = None, runner_command: Sequence[str] = RUNNER_COMMAND):
        self.store = store
        self.config = config
        self.log_dir = log_dir
        self.planner = planner or Planner(lambda: self.config)
        self.runner_command = tuple(runner_command)
        self.models: dict[str, LoadedRunner] = {}
        self.on_answer: Callable[[str, Done], None] | None = None  # each answer (metrics)
        self._replans: dict[str, int] = {}  # times each model was planned again (MAX_REPLANS)
        self.replan_idle_s = REPLAN_IDLE_S
        self.queued = 0  # requests waiting for a slot or a load, over all models
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._room_lock = asyncio.Lock()
        self._loading: set[str] = set()  # models being loaded: they count toward the limit
        self._room_freed = asyncio.Event()  # a model went idle or away: room may be made
        self._reaper: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self.starter = RunnerStarter(self.planner, lambda: self.config, log_dir,
                                     self.runner_command)
        self.crashes = self.starter.crashes  # runners that died on their own (ps shows notes)
        # Runners busy on the CPU at once share its threads (_share_cpu); `off` for benchmarks
        # that compare with every runner at its plan's threads (scripts/bench/bench_cpu_share.py)
        self.cpu_share = os.environ.get("LOCALLLM_CPU_SHARE", "on") != "off"

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_expired())

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for name in list(self.models):
            await self.unload(name)
        await drained()  # the tuner's records of the last answers, written before we go

    def apply_config(self, config: Config) -> None:
        """Settings that take effect without a restart: keep_alive default, limits, defaults."""
        self.config = config
        self._wake.set()

    def _lock(self, name: str) -> asyncio.Lock:
        return self._model_locks.setdefault(name, asyncio.Lock())

    # ---- use ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, entry: ModelEntry, load: LoadOptions,
                  keep_alive: float | None | str = "default",
                  prompt_chars: int = 0, hint: str | None = None) -> AsyncIterator[RunnerProcess]:
        """Hold one slot of the model's runner for one request, loading it as needed (in the
        fill band a prompt of `prompt_chars` characters needs; `hint`: what the route says of
        the session, for a model not yet seen serving: profiles.traffic)."""
        name = entry.name.tagged
        keep = self.config.keep_alive_seconds if keep_alive == "default" else keep_alive
        model = await self._acquire(entry, load, prompt_chars, hint)
        model.active += 1
        model.crowded = model.crowded or model.active > 1
        model.expires_at = None
        try:
            if model.active == 1:
                await self._share_cpu(model)
            yield model.runner
        finally:
            model.active -= 1
            model.last_used = time.time()
            model.keep_alive = keep
            if model.active == 0:
                model.crowded = False
                model.expires_at = None if keep is None else time.time() + keep
                asyncio.ensure_future(self._share_cpu())
                self._room_freed.set()
            model.slots.release()
            self._wake.set()
            if keep == 0 and model.idle and self.models.get(name) is model:
                asyncio.ensure_future(self._unload_if_idle(name, model))

    async def _share_cpu(self, entering: LoadedRunner | None = None) -> None:
        """Tell each busy runner that computes on the CPU how many do at once: each takes its
        plan's share of the threads (engine/runner/step.py). The runner of a request that starts
        (`entering`) hears it before the request; the others between two of their steps."""
        if not self.cpu_share:
            return
        busy = [m for m in self.models.values() if m.active and computes_on_cpu(m)]
        for model in busy:
            if model is not entering:
                asyncio.ensure_future(model.runner.share_cpu(len(busy)))
        for model in self.models.values():  # idle now: its plan's threads back (and in ps)
            if not model.active and model.runner.cpu_share != 1:
                asyncio.ensure_future(model.runner.share_cpu(1))
        if entering in busy:
            await entering.runner.share_cpu(len(busy))

    async def _acquire(self, entry: ModelEntry, load: LoadOptions,
                       prompt_chars: int = 0, hint: str | None = None) -> LoadedRunner:
        """A slot of a loaded, current runner for this request (503 past the queue's limits)."""
        if self.queued >= self.config.max_queue:
            raise QueueFull(f"{self.queued} requests are already waiting; try again later")
        self.queued += 1
        deadline = time.monotonic() + self.config.queue_timeout_seconds
        try:
            while True:
                model = await self._loaded(entry, load, prompt_chars, hint)
                model.waiting += 1
                try:
                    await asyncio.wait_for(model.slots.acquire(),
                                           max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise QueueFull(f"waited {self.config.queue_timeout}s for {entry.name} "
                                    f"to be free; try again later") from None
                finally:
                    model.waiting -= 1
                if model.runner.alive and self.models.get(entry.name.tagged) is model:
                    return model
                model.slots.release()  # it died or was replaced while we waited: again
        finally:
            self.queued -= 1

    def _current(self, model: LoadedRunner | None, entry: ModelEntry, load: LoadOptions) -> bool:
        return bool(model and model.runner.alive and model.entry.digest == entry.digest
                    and model.serves(load)
                    and file_id(model.runner.model_path) == model.file_id
                    and not model.replan_now)

    async def _loaded(self, entry: ModelEntry, load: LoadOptions,
                      prompt_chars: int = 0, hint: str | None = None) -> LoadedRunner:
        """The loaded, current runner of `entry` for `load`, loading it where needed (the load
        a re-plan decided for these options, `LoadedRunner.decided`, rather than planning it
        again, whichever request gets here first)."""
        name = entry.name.tagged
        model = self.models.get(name)
        if self._current(model, entry, load):
            return model  # the common case takes no lock
        async with self._lock(name):
            model = self.models.get(name)
            if self._current(model, entry, load):
                return model
            # What the request asks that cannot be done fails here, once, before the loaded model
            # is retired: a bad request must not cost a reload.
            try:
                shape = await asyncio.to_thread(read_shape, entry.model_path)
                draft = draft_model(self.store, entry, load)
                draft_shape = await asyncio.to_thread(read_shape, draft.path) if draft.path \
                    else None
            except (GGUFError, OSError) as e:  # truncated or rewritten under us
                if model is not None:  # its runner's file is gone too: retire it
                    del self.models[name]
                    await self._retire(name, model)
                raise DamagedModel(name, str(e).replace(str(entry.model_path), "its blob")) \
                    from None
            check_speculation(entry, shape, load, draft, draft_shape)
            decided = model.decided if model and model.replan_now and \
                model.load.asked == load else None
            if model is not None:
                if model.runner.alive and file_id(model.runner.model_path) != model.file_id:
                    log.warning("the file of %s changed under it; loading it again", name)
                elif model.replan_now:
                    log.info("loading %s again, priced from its hits: %s", name, model.replan)
                del self.models[name]  # new requests wait for the new load, not this one
                await self._retire(name, model)
            async with self._room_lock:
                await self._make_room(time.monotonic() + self.config.queue_timeout_seconds)
                self._loading.add(name)
            try:
                return await self._load_new(name, entry, shape, load, draft, draft_shape,
                                            hint, prompt_chars, decided)
            finally:
                self._loading.discard(name)
                self._room_freed.set()

    async def _load_new(self, name: str, entry: ModelEntry, shape: ModelShape,
                        load: LoadOptions, draft, draft_shape, hint: str | None,
                        prompt_chars: int, decided: Load | None = None) -> LoadedRunner:
        """Plan (unless `decided`) and start the model's runner (room made for it), and
        register it."""
        if decided is None:
            # One planning call decides the load (it may probe the GPU and dry-run llama.cpp:
            # seconds, off the event loop).
            started = time.monotonic()
            await drained()  # what the answers served so far taught the tuner, written
            decided = await asyncio.to_thread(
                self.planner.decide, self.config, entry, shape, load, draft, draft_shape,
                projector_path(self.store, entry), hint, prompt_chars)
            log.info("planned %s in %.1fs", name, time.monotonic() - started)
        path = model_file(self.store, entry)
        runner = await self.starter.start(name, path, shape, decided)
        model = LoadedRunner(runner=runner, entry=entry, shape=shape, file_id=file_id(path),
                            load=decided, keep_alive=self.config.keep_alive_seconds)
        records = ServedRecords(name, shape.file_size, shape.expert_count)
        runner.on_drafts = records.drafted
        runner.on_done = lambda done: self._served(model, records, done)
        runner.on_death = lambda plan, why, code: self.crashes.record(
            name, plan, why, runner.log_path, code)
        self.models[name] = model
        return model

    def _served(self, model: LoadedRunner, records: ServedRecords, done: Done) -> None:
        """After each answer: the metrics', and the tuner's records (LoadedRunner.answered),
        and a re-plan where one is due (at most MAX_REPLANS a model to correct prices, and
        MAX_WAY_TRIALS more to measure ways)."""
        name = model.entry.name.tagged
        if self.on_answer is not None:
            self.on_answer(name, done)
        if why := model.answered(records, done, self.config.expert_cache,
                                 self._replans.get(name, 0), self.planner.card):
            self._replan_due(model, why)

    async def _retire(self, name: str, model: LoadedRunner) -> None:
        """Unload a replaced runner once the answers it is giving have ended."""
        if model.runner.alive:
            for _ in range(model.runner.n_parallel):
                await model.slots.acquire()
        await model.runner.stop()
        log.info("unloaded %s", name)

    async def _make_room(self, deadline: float) -> None:
        """Unload the least recently used idle model while at the loaded-model limit (models
        being loaded count); when every one is answering, wait for one to finish, as Ollama's
        scheduler does (QueueFull past the queue's timeout)."""
        limit = self.config.max_loaded_models
        while len(self.models) + len(self._loading) >= limit:
            idle = [(m.last_used, n) for n, m in self.models.items() if m.idle]
            if idle:
                name = min(idle)[1]
                await self._unload_if_idle(name, self.models[name])
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise QueueFull(f"{limit} models are loaded and answering (max_loaded_models "
                                f"= {limit}); try again when one is free")
            self._room_freed.clear()
            with contextlib.suppress(TimeoutError):  # re-checked at least every second
                await asyncio.wait_for(self._room_freed.wait(), min(left, 1.0))

    # ---- unload ------------------------------------------------------------------------
    async def unload(self, name: str) -> bool:
        """Unload now (rm, stop, keep_alive 0): answers in progress are cancelled first."""
        model = self.models.get(name)
        if model is None:
            return False
        async with self._lock(name):
            if self.models.get(name) is model:
                del self.models[name]
            await model.runner.stop()
            log.info("unloaded %s", name)
        self._room_freed.set()
        return True

    async def _unload_if_idle(self, name: str, model: LoadedRunner,
                              expired_only: bool = False) -> None:
        """Unload `model` if, once its lock is held, it is still the loaded one and nobody uses
        or waits for it (the state is checked after the wait, never before)."""
        async with self._lock(name):
            if self.models.get(name) is not model or not model.idle:
                return
            if expired_only and (model.expires_at is None or model.expires_at > time.time()):
                return
            del self.models[name]
            await model.runner.stop()
            log.info("unloaded %s", name)

    async def _reap_expired(self) -> None:
        while True:
            now = time.time()
            next_check = 60.0
            for name, model in list(self.models.items()):
                if not model.runner.alive and model.active == 0:
                    await self._unload_if_idle(name, model)
                elif model.replan and model.idle and not model.replan_now:
                    due = model.last_used + self.replan_idle_s - now
                    if due <= 0:
                        asyncio.ensure_future(self._replan(model))
                    else:
                        next_check = min(next_check, due)
                elif model.expires_at is not None and model.idle:
                    if model.expires_at <= now:
                        await self._unload_if_idle(name, model, expired_only=True)
                    else:
                        next_check = min(next_check, model.expires_at - now)
            self._wake.clear()
            # Not wait_for: cancelling a wait_for on an Event hung close() on Python 3.11.
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({woken}, timeout=max(next_check, 0.05))
            finally:
                woken.cancel()


def computes_on_cpu(model: LoadedRunner) -> bool:
    """Whether the model's running plan leaves work to the CPU's threads: a block or the
    output layer there (llama.cpp's n_gpu_layers counts the output as one more), or tensors
    an override keeps there (MoE experts)."""
    plan = model.runner.running_plan
    return plan.n_gpu_layers <= model.shape.n_layer \
        or any(o.device == "CPU" for o in plan.tensor_overrides)
