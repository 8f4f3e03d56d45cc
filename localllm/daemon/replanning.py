"""When a loaded model is planned again (issue #65): after an answer whose figures say its plan
was priced wrong (its expert pool's hit rate, or its decode against the plan's curve:
LoadedRunner.answered, profiles/served.py), and only once the model has been idle
`replan_idle_s`, between requests. A new plan that starts the same runner is kept at its new
price, not loaded again.

A part of the Scheduler (its base class): it uses the scheduler's models (each a
scheduler.LoadedRunner), locks, planner and `_loaded`, and the reaper (`_reap_expired`) starts
`_replan` when one is due.
"""

from __future__ import annotations

import asyncio
import logging

from localllm.engine.runner.load import Load
from localllm.modelstore.shape import read_shape
from localllm.modelstore.store import projector_path
from localllm.profiles.served import drained

from .drafting import draft_model
from .starting import reprice

log = logging.getLogger("localllm.scheduler")

# Re-plans of one model in a daemon's life: its pool's hits or its decode far from the price
# (each corrects a price, so the next plan is priced closer); the second lets the way the first
# re-plan moved to be measured and corrected in turn, and then the model stays as it is.
MAX_REPLANS = 2
# Re-plans past those that load another way `auto` weighed (planner/ways.py), per plan the
# runner switches between (each fill band and the whole context weigh their own ways): each of
# at most three ways measured once, and the fastest loaded; a record that cannot be written
# must not make it measure the same ways again for ever. One budget for a whole banded runner
# left an H100 lease's 32K band on the slowest of its ways (no pool, 42-50 tok/s after a 16K
# prompt) once its last way was measured, where the pool with misses on the GPU had done 61.
MAX_WAY_TRIALS = 3


def way_trial_allowed(replans: int, n_plans: int) -> bool:
    """Whether a model planned again `replans` times may be again to load another way, its
    runner switching between `n_plans` plans (fill bands and the whole context)."""
    return replans < MAX_REPLANS + MAX_WAY_TRIALS * n_plans


class Replanning:
    """The scheduler's re-plans (see the module's words)."""

    _replans: dict[str, int]  # times each model was planned again (MAX_REPLANS)

    def _replan_due(self, model, why: str) -> None:
        """An answer says `model`'s plan was priced wrong (`why`): it is planned again once it
        has been idle replan_idle_s (the reaper starts `_replan`)."""
        name = model.entry.name.tagged
        self._replans[name] = self._replans.get(name, 0) + 1
        model.replan = why
        log.info("%s: %s; it is planned again with that price once idle %.0f s",
                 name, why, self.replan_idle_s)
        self._wake.set()

    async def _replan(self, model) -> None:
        """Plan `model` again with the prices it measured (`replan`), now that it has been idle
        replan_idle_s, and load the new plan where it differs from the running one (the same
        plan is kept, its prediction made again); a request that comes meanwhile waits, as for
        any load. A failure is the next request's to report."""
        name = model.entry.name.tagged
        model.replan_now = True  # no longer current: requests wait for the decision
        try:
            async with self._lock(name):
                if self.models.get(name) is not model:
                    return
                decided = await self._decide_again(model)
                if decided.starts_same_runner(model.load):
                    # the runner's plans at their new prices: its next answers are checked
                    # against them (a new DecodeCheck), and ps shows them
                    reprice(model.runner, decided)
                    model.load, model.replan, model.replan_now = decided, "", False
                    log.info("%s: priced again, the same plan serves (predicted decode %.1f "
                             "tok/s)", name, decided.plan.predicted_decode_tps)
                    return
                log.info("loading %s again with a plan priced from what it served: %s",
                         name, model.replan)
                model.decided = decided  # for whichever request loads it first, or this
            await self._loaded(model.entry, model.load.asked)
        except Exception as e:
            model.replan, model.replan_now = "", False  # not tried again: it stays as loaded
            log.warning("could not plan %s again: %s", model.entry.name, e)

    async def _decide_again(self, model) -> Load:
        """What a load of `model` with its load options would be now (records written first)."""
        entry, asked = model.entry, model.load.asked
        draft = draft_model(self.store, entry, asked)
        draft_shape = await asyncio.to_thread(read_shape, draft.path) if draft.path else None
        await drained()
        return await asyncio.to_thread(
            self.planner.decide, self.config, entry, model.shape, asked, draft, draft_shape,
            projector_path(self.store, entry))
