"""When a loaded model is planned again (issue #65): after an answer whose figures say its plan
was priced wrong (its expert pool's hit rate, or its decode against the plan's curve:
profiles/served_speed.py), and only once the model has been idle `replan_idle_s`, between
requests. A new plan that starts the same runner is kept at its new price, not loaded again.

A part of the Scheduler (its base class): it uses the scheduler's models, locks, planner and
`_loaded`, and the reaper (`_reap_expired`) starts `_replan` when one is due.
"""

from __future__ import annotations

import asyncio
import logging

from localllm.engine.runner.load import Load
from localllm.engine.runner.protocol import Done
from localllm.modelstore.shape import read_shape
from localllm.modelstore.store import projector_path
from localllm.profiles.served import ServedRecords, drained
from localllm.profiles.served_speed import DecodeCheck

from .drafting import draft_model
from .loaded import LoadedRunner, repriced, same_load

log = logging.getLogger("localllm.scheduler")

# Re-plans of one model in a daemon's life: its pool's hits or its decode far from the price
# (each corrects a price, so the next plan is priced closer); the second lets the way the first
# re-plan moved to be measured and corrected in turn, and then the model stays as it is.
MAX_REPLANS = 2


class Replanning:
    """The scheduler's re-plans (see the module's words)."""

    _replans: dict[str, int]  # times each model was planned again (MAX_REPLANS)

    def _served(self, model: LoadedRunner, records: ServedRecords, done: Done) -> None:
        """After each answer: its records for the tuner (written off the event loop), and a
        re-plan where due (at most MAX_REPLANS a model)."""
        name, runner = model.entry.name.tagged, model.runner
        if self.on_answer is not None:
            self.on_answer(name, done)
        records.answered(done.prompt_tokens, done.prompt_tokens - done.cached_tokens,
                         done.eval_count, runner.expert_cache)
        if model.replan or self._replans.get(name, 0) >= MAX_REPLANS:
            model.check_speed(done)
            return
        why = records.replan_reason(runner.expert_cache, runner.running_plan,
                                    self.config.expert_cache)
        if not why and (why := model.check_speed(done)):
            records.repriced(model.speed, model.shape, self.planner.card, runner.expert_cache)
        if why:
            self._replans[name] = self._replans.get(name, 0) + 1
            model.replan = why
            log.info("%s: %s; it is planned again with that price once idle %.0f s",
                     name, why, self.replan_idle_s)
            self._wake.set()

    async def _replan(self, model: LoadedRunner) -> None:
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
                if same_load(decided, model.load):
                    model.load, model.replan, model.replan_now = decided, "", False
                    if (plan := repriced(decided, model.runner.running_plan)) is not None:
                        model.speed = DecodeCheck(plan)
                    log.info("%s: priced again, the same plan serves (predicted decode %.1f "
                             "tok/s)", name, decided.plan.predicted_decode_tps)
                    return
                log.info("loading %s again with a plan priced from what it served: %s",
                         name, model.replan)
            await self._loaded(model.entry, model.load.asked, decided=decided)
        except Exception as e:
            model.replan, model.replan_now = "", False  # not tried again: it stays as loaded
            log.warning("could not plan %s again: %s", model.entry.name, e)

    async def _decide_again(self, model: LoadedRunner) -> Load:
        """What a load of `model` with its load options would be now (records written first)."""
        entry, asked = model.entry, model.load.asked
        draft = draft_model(self.store, entry, asked)
        draft_shape = await asyncio.to_thread(read_shape, draft.path) if draft.path else None
        await drained()
        return await asyncio.to_thread(
            self.planner.decide, self.config, entry, model.shape, asked, draft, draft_shape,
            projector_path(self.store, entry))
