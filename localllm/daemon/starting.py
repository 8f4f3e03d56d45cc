"""Starting a model's runner as the load decision says: in its first fill band; with a smaller
plan when llama.cpp refuses the plan (out of VRAM, as a rule); without llama.cpp's extra buffer
types once the engine crashed with them on this CPU while loading this model (an engine built
with AMX on an AMX CPU goes without them from the start: the runner sees to it, engine/cpu.py
amx_hazard); and without the expert cache's risky parts once runners crashed twice with them
on (daemon/crashes.py). The scheduler decides what to load and when; this owns how a load is
attempted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from localllm.engine.local import EngineCrashed, LoadError, RunnerProcess
from localllm.engine.runner.load import Load
from localllm.modelstore.shape import ModelShape
from localllm.planner.plan import Plan
from localllm.planner.vision import with_room_for_images

from localllm.config import Config

from .crashes import Crashes
from .planner import Planner

log = logging.getLogger("localllm.scheduler")


def without_extra_bufts(plan: Plan, bands: tuple[Plan, ...],
                        why: str) -> tuple[Plan, tuple[Plan, ...]]:
    """The plan and its bands with llama.cpp's extra buffer types off, `why` among its reasons
    (ps and the log show them)."""
    def off(p: Plan) -> Plan:
        return replace(p, extra_bufts=False, reasons=(*p.reasons, why))

    return off(plan), tuple(off(b) for b in bands)


class RunnerStarter:
    def __init__(self, planner: Planner, config: Callable[[], Config], log_dir: Path,
                 command: Sequence[str]):
        self.planner = planner
        self.config = config
        self.log_dir = log_dir
        self.command = tuple(command)
        # model -> why: set once the engine crashed loading that model with llama.cpp's extra
        # buffer types and loaded without them; its later loads go without them at once
        self.crashes = Crashes()

    async def start(self, name: str, path, shape: ModelShape, load: Load) -> RunnerProcess:
        """Load with the plan (in its first fill band); when llama.cpp refuses it (out of
        memory, as a rule, on a GPU), retry with the planner's next smaller plan, which it
        records in the saved profile, and no bands. A runner that died or hung while loading
        is not stepped down: the same error comes back. An engine that crashed on this CPU
        is retried once without llama.cpp's extra buffer types."""
        plan, bands, start_band = load.plan, load.bands, load.start_band
        noted = self.crashes.no_extra_bufts.get(name, "")
        if plan.extra_bufts and noted:
            plan, bands = without_extra_bufts(plan, bands, noted)
        plan, bands = self.crashes.safer(name, plan, bands)
        turned_off = False  # this start turned them off after a crash
        while True:
            try:
                return await self._start(name, path, replace(
                    load, plan=plan, bands=bands, start_band=start_band,
                    draft_path=load.draft_path if plan.draft_mode.draft_model else None))
            except EngineCrashed as e:
                if not plan.extra_bufts:
                    if turned_off or noted:
                        # it crashed without them too: the model's fault, not theirs
                        self.crashes.no_extra_bufts.pop(name, None)
                        log.warning("%s crashed with llama.cpp's extra buffer types off too; "
                                    "they were not the cause and are on again at its next "
                                    "load", name)
                    raise
                log.warning("%s; retrying with llama.cpp's extra buffer types (repack, AMX) "
                            "off", e)
                why = ("extra buffer types (repack, AMX) off: llama.cpp crashed with them "
                       "loading this model here")
                plan, bands = without_extra_bufts(plan, bands, why)
                self.crashes.no_extra_bufts[name] = why
                turned_off = True
            except LoadError as e:
                if bands:  # the first band's plan failed: the whole context's, alone, next
                    log.warning("loading %s in its %d-token fill band failed (%s); loading "
                                "the whole context's plan without bands", name, bands[0].n_ctx,
                                e)
                    bands, start_band = (), 0
                    continue
                if not e.refused:  # died or hung: less on the GPU would not help
                    raise
                smaller = await asyncio.to_thread(self.planner.step_down, plan, shape, name,
                                                  str(e))
                if smaller is None:
                    raise
                log.warning("loading %s failed (%s); retrying with a smaller plan: %s",
                            name, e, smaller.reasons[-1] if smaller.reasons else "")
                # (the planner's rule for a projector's images holds for the smaller plan too)
                plan, bands = with_room_for_images(smaller, load.image_tokens), ()

    async def _start(self, name: str, path, load: Load) -> RunnerProcess:
        """Start a runner with the load's values (a stepped-down plan in place of its own)."""
        plan, bands, start_band = load.plan, load.bands, load.start_band
        runner = RunnerProcess.of(name, replace(load, model_path=Path(path)),
                                  self.log_dir / "runner.log", self.command)
        log.info("loading %s: %s", name, "; ".join(plan.reasons))
        if start_band < len(bands):
            log.info("%s starts in the %d-token fill band (of %s): %s", name,
                     bands[start_band].n_ctx, ", ".join(str(b.n_ctx) for b in (*bands, plan)),
                     "; ".join(bands[start_band].reasons))
        try:
            await runner.start(timeout=self.config().load_timeout_seconds)
        except LoadError:
            await runner.stop()
            raise
        log.info("loaded %s in %.2fs (pid %s, %d slots)", name, runner.load_duration_ns / 1e9,
                 runner.pid, runner.n_parallel)
        return runner


def reprice(runner: RunnerProcess, load: Load) -> None:
    """Give `runner` `load`'s plans, which start that very runner (the same load keys) at other
    prices: what it predicts follows (ps, the served-speed check), nothing that it runs."""
    if not runner.load.starts_same_runner(load):
        raise ValueError("reprice takes plans that start the same runner")
    runner.plan, runner.bands = load.plan, tuple(load.bands)
    runner.load = replace(runner.load, plan=load.plan, bands=tuple(load.bands))
