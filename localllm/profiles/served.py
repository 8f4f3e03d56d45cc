"""What serving a loaded model teaches the tuner, recorded off the daemon's event loop.

After each answer: the request's lengths, for the workload the next load is planned for
(`traffic.py`); the draft acceptance of each mode, every FLUSH_DRAFTED drafted tokens rather than
after every answer (`acceptance.py`); the expert pool's hits so far (`expert_hits.py`); and,
when a plan decoded far from its price, the factor serving measured (`served_speed.py`). And
the one decision the hits lead to: whether the pool hits so far from the rate its plan was
priced with that the model should be planned again once idle.

Each write reads and rewrites a small state file: one writer thread for the whole daemon keeps
them in order and away from the event loop, and a full disk costs a warning, never an answer.
`drained` waits for the writes queued so far, so a load planned next reads them.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from . import acceptance, expert_hits, served_speed, traffic

log = logging.getLogger("localllm.scheduler")
_writer = ThreadPoolExecutor(1, "tuner-records")


class ServedRecords:
    """One loaded model's records for the tuner (its name and weights file's size key them)."""

    FLUSH_DRAFTED = 64

    def __init__(self, model: str, file_size: int, expert_count: int = 0):
        self.model, self.file_size, self.expert_count = model, file_size, expert_count
        self.traffic_file = traffic.traffic_file()  # found once, not after every answer
        self.pending: dict[str, list[int]] = {}  # drafted and accepted per mode, not yet written

    def drafted(self, mode: str, drafted: int, accepted: int) -> None:
        """An answer that drafted with `mode` (a runner's on_drafts)."""
        counts = self.pending.setdefault(mode, [0, 0])
        counts[0] += drafted
        counts[1] += accepted
        if counts[0] >= self.FLUSH_DRAFTED:
            _write("draft acceptance", acceptance.record, self.model, self.file_size, mode,
                   *counts)
            self.pending[mode] = [0, 0]

    def answered(self, prompt_tokens: int, read_tokens: int, answer_tokens: int,
                 pool=None) -> None:
        """An answer's lengths (`read_tokens`: the prompt's tokens not reused from the cache)
        and, for a model with an expert pool, the pool's figures since its load (frozen)."""
        _write("the workload record", traffic.record, self.model, prompt_tokens, read_tokens,
               answer_tokens, self.traffic_file)
        if pool is not None:
            _write("the expert cache's hit rate", expert_hits.record_pool, self.model,
                   self.file_size, self.expert_count, pool)

    def repriced(self, check, shape, card, pool=None) -> None:
        """A plan whose decode was far from its price (`check`: served_speed.DecodeCheck):
        the error laid on this machine's price it belongs to, and stored for the next plan.
        `card`: gives this machine's card as the planner sees it (it probes: off the loop)."""
        def run() -> None:
            try:
                blamed = served_speed.blame(check, shape, card(), pool)
            except Exception as e:  # a price that cannot be made must not stop the writer
                log.warning("%s: could not price its plan again: %s", self.model, e)
                return
            if blamed is None:
                log.info("%s: no host price to correct for its plan's decode", self.model)
                return
            field, factor = blamed
            served_speed.store(field, factor, self.model)
            log.info("%s: %s is now %.3f (what serving measured)", self.model, field, factor)

        _write("the served-speed factor", run)

    @staticmethod
    def replan_reason(pool, plan, setting: int | str) -> str:
        """Why the model should be planned again once idle ("": it should not): its expert
        pool, sized by `auto`, hits far from the rate `plan` was priced with."""
        if pool is None:
            return ""
        return expert_hits.pool_far_from_its_price(pool, plan, setting)


def _write(what: str, record, *args) -> None:
    def run() -> None:
        try:
            record(*args)
        except OSError as e:  # a full disk must not fail the answer
            log.warning("could not save %s: %s", what, e)

    _writer.submit(run)


async def drained() -> None:
    """Once every record queued so far is written (the writer takes them in order)."""
    await asyncio.wrap_future(_writer.submit(lambda: None))
