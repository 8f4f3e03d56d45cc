"""Which models are loaded, who may use them, and when they go away.

One runner process per loaded model, serving one request at a time (requests queue on a
per-runner lock). A request whose load options differ from the loaded runner's (a new num_ctx)
reloads it. keep_alive follows Ollama: a duration after the last request, 0 unloads at once,
negative keeps the model loaded until the daemon stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from localllm.modelstore.pull import model_file
from localllm.modelstore.shape import ModelShape, read_shape
from localllm.modelstore.store import ModelEntry, ModelStore
from localllm.profiles.plan import Plan

from localllm.config import Config

from .runner.process import LoadError, RunnerProcess

log = logging.getLogger("localllm.scheduler")


class QueueFull(Exception):
    """Too many requests are waiting (status 503)."""


@dataclass
class Slot:
    """A loaded model: its runner, who is waiting for it, and when it expires."""
    runner: RunnerProcess
    entry: ModelEntry
    shape: ModelShape  # read once at load; /api/ps and /api/stats use it
    lock: asyncio.Lock
    waiting: int = 0
    keep_alive: float | None = 300.0  # seconds after the last request; None = forever
    expires_at: float | None = None  # wall-clock time; None while in use or kept forever
    last_used: float = 0.0


class Planner:
    """How the scheduler gets plans: the tuner's `choose_plan`, and `step_down` after a load
    ran out of memory. Tests may pass another planner; the scheduler needs only these two."""

    def choose(self, shape: ModelShape, model_name: str, n_ctx: int | None,
               options: dict) -> Plan:
        from localllm.profiles.choose import choose_plan

        return choose_plan(shape, model_name, n_ctx, options)

    def step_down(self, plan: Plan, shape: ModelShape, model_name: str,
                  error: str) -> Plan | None:
        from localllm.profiles.choose import step_down
        from localllm.profiles.hardware import probe_card

        return step_down(plan, shape, probe_card(), model_name, error)


def context_to_ask(config: Config, n_ctx: int | None, shape: ModelShape) -> int | None:
    """The context a load asks the planner for: the request's num_ctx, else by policy."""
    if n_ctx is not None:
        return n_ctx
    if config.context_policy == "fixed":
        return config.default_ctx
    if config.context_policy == "max":
        return shape.context_length or config.default_ctx
    return None  # "fit": the tuner picks the largest context that keeps the model fast


class Scheduler:
    def __init__(self, store: ModelStore, config: Config, log_dir,
                 planner: Planner | None = None):
        self.store = store
        self.config = config
        self.log_dir = log_dir
        self.planner = planner or Planner()
        self.slots: dict[str, Slot] = {}
        self._load_lock = asyncio.Lock()
        self._reaper: asyncio.Task | None = None
        self._wake = asyncio.Event()

    # ---- lifecycle ---------------------------------------------------------------------
    async def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_expired())

    async def close(self) -> None:
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for name in list(self.slots):
            await self.unload(name)

    def apply_config(self, config: Config) -> None:
        """Settings that take effect without a restart: keep_alive default, limits, defaults."""
        self.config = config
        self._wake.set()

    # ---- use ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def use(self, entry: ModelEntry, n_ctx: int | None, options: dict,
                  keep_alive: float | None | str = "default") -> AsyncIterator[RunnerProcess]:
        """Hold the model's runner for one request, loading (or reloading) it as needed."""
        name = str(entry.name)
        keep = self.config.keep_alive_seconds if keep_alive == "default" else keep_alive
        waiting = sum(slot.waiting for slot in self.slots.values())
        if waiting >= self.config.max_queue:
            raise QueueFull(f"{waiting} requests are already waiting; try again later")
        while True:
            slot = await self._slot_for(entry, n_ctx, options)
            slot.waiting += 1
            try:
                await slot.lock.acquire()
            finally:
                slot.waiting -= 1
            if slot.runner.alive and self.slots.get(name) is slot:
                break
            slot.lock.release()  # it died or was replaced while we queued: load again
        slot.expires_at = None
        try:
            yield slot.runner
        finally:
            slot.last_used = time.time()
            slot.keep_alive = keep
            slot.expires_at = None if keep is None else time.time() + keep
            slot.lock.release()
            self._wake.set()

    async def _slot_for(self, entry: ModelEntry, n_ctx: int | None, options: dict) -> Slot:
        name = str(entry.name)
        async with self._load_lock:
            slot = self.slots.get(name)
            if slot and slot.runner.alive and slot.entry.digest == entry.digest and (
                n_ctx is None or n_ctx == slot.runner.plan.n_ctx
            ) and not _load_options_differ(slot.runner.plan, options):
                return slot
            if slot:
                async with slot.lock:  # an answer in progress finishes before the reload
                    await self._unload_slot(name, slot)
            await self._make_room()
            shape = await asyncio.to_thread(read_shape, entry.model_path)
            # Planning may probe the GPU and dry-run llama.cpp: seconds, off the event loop.
            plan = await asyncio.to_thread(self.planner.choose, shape, name,
                                           context_to_ask(self.config, n_ctx, shape), options)
            runner = await self._load_stepping_down(name, entry, shape, plan)
            slot = Slot(runner=runner, entry=entry, shape=shape, lock=asyncio.Lock(),
                        keep_alive=self.config.keep_alive_seconds)
            self.slots[name] = slot
            return slot

    async def _load_stepping_down(self, name: str, entry: ModelEntry, shape: ModelShape,
                                  plan: Plan) -> RunnerProcess:
        """Load with `plan`; when the load fails (out of memory, as a rule, on a GPU), retry
        with the planner's next smaller plan, which it records in the saved profile."""
        while True:
            try:
                return await self._load(name, entry, plan)
            except LoadError as e:
                smaller = await asyncio.to_thread(self.planner.step_down, plan, shape, name,
                                                  str(e))
                if smaller is None:
                    raise
                log.warning("loading %s failed (%s); retrying with a smaller plan: %s",
                            name, e, smaller.reasons[-1] if smaller.reasons else "")
                plan = smaller

    async def _load(self, name: str, entry: ModelEntry, plan: Plan) -> RunnerProcess:
        runner = RunnerProcess(name, model_file(self.store, entry), plan,
                               self.log_dir / "runner.log")
        log.info("loading %s: %s", name, "; ".join(plan.reasons))
        try:
            await runner.start()
        except LoadError:
            await runner.stop()
            raise
        log.info("loaded %s in %.2fs (pid %s)", name, runner.load_duration_ns / 1e9, runner.pid)
        return runner

    async def _make_room(self) -> None:
        """Unload the least recently used idle model while at the loaded-model limit."""
        while len(self.slots) >= self.config.max_loaded_models:
            idle = [(s.last_used, n) for n, s in self.slots.items()
                    if not s.lock.locked() and not s.waiting]
            if not idle:
                return  # everything is busy: load beside them rather than deadlock
            await self._unload_slot(min(idle)[1], self.slots[min(idle)[1]])

    async def unload(self, name: str) -> bool:
        slot = self.slots.get(name)
        if slot is None:
            return False
        async with self._load_lock:
            await self._unload_slot(name, slot)
        return True

    async def _unload_slot(self, name: str, slot: Slot) -> None:
        if self.slots.get(name) is slot:
            del self.slots[name]
        await slot.runner.stop()
        log.info("unloaded %s", name)

    async def _reap_expired(self) -> None:
        while True:
            now = time.time()
            next_check = 60.0
            for name, slot in list(self.slots.items()):
                if not slot.runner.alive and not slot.lock.locked():
                    await self.unload(name)
                elif slot.expires_at is not None and not slot.lock.locked() and not slot.waiting:
                    if slot.expires_at <= now:
                        await self.unload(name)
                    else:
                        next_check = min(next_check, slot.expires_at - now)
            self._wake.clear()
            # Not wait_for: cancelling a wait_for on an Event hung close() on Python 3.11.
            woken = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({woken}, timeout=max(next_check, 0.05))
            finally:
                woken.cancel()


def _load_options_differ(plan: Plan, options: dict) -> bool:
    """Ollama's load-time options that, when given, must match the loaded runner."""
    if "num_gpu" in options and options["num_gpu"] != plan.n_gpu_layers:
        return True
    if "num_thread" in options and options["num_thread"] != plan.n_threads:
        return True
    return "num_batch" in options and options["num_batch"] != plan.n_batch
