"""What serving a loaded model teaches the tuner, recorded off the daemon's event loop.

After each answer: the request's lengths, for the workload the next load is planned for
(`traffic.py`); the draft acceptance of each mode, every FLUSH_DRAFTED drafted tokens rather
than after every answer (`acceptance.py`); the expert pool's hits so far (`expert_hits.py`);
what the plan's way decoded where `auto` weighed ways priced too close to trust (`ways.py`);
and, when a plan decoded far from its price, the factor serving measured (`served_speed.py`).
And the decisions they lead to: whether the pool hits so far from the rate its plan was priced
with, or the answers decode so far from the plan's curve (`DecodeCheck`: the seconds they took
against the seconds the curve gives at each answer's depth, once MIN_CHECK_TOKENS are in), or
another way is still to be measured, that the model should be planned again once idle.

Each write reads and rewrites a small state file: one writer thread for the whole daemon keeps
them in order and away from the event loop, and a full disk costs a warning, never an answer.
`drained` waits for the writes queued so far, so a load planned next reads them.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass

from localllm.planner.plan import Plan

from . import acceptance, expert_hits, served_speed, served_vram, traffic, ways

log = logging.getLogger("localllm.scheduler")
_writer = ThreadPoolExecutor(1, "tuner-records")

MIN_CHECK_TOKENS = 96  # decoded tokens before a plan is judged: a few answers, not one
MIN_ANSWER_TOKENS = 8  # an answer shorter than this times its first steps, not decode
OFF_BY = 0.15  # how far measured decode may be from the prediction before it is priced again


@dataclass
class DecodeCheck:
    """Decode measured while serving `plan`, against its predicted curve: answers that ran
    alone on the runner, without drafting (the scheduler decides which count)."""

    plan: Plan
    # Whether the plan computes part of a step on the host or reads missed experts from it
    # (has_host_part): only then is its error a price that serving may correct.
    on_host: bool = False
    tokens: int = 0
    seconds: float = 0.0
    predicted_seconds: float = 0.0
    depth_tokens: int = 0  # sum of each answer's middle depth x its tokens
    way_measured: bool = False  # what the plan's way decoded is stored (ServedRecords)

    def add(self, prompt_tokens: int, eval_count: int, eval_seconds: float) -> None:
        curve = self.plan.predicted_decode_by_depth
        if eval_count < MIN_ANSWER_TOKENS or eval_seconds <= 0 or not curve:
            return
        depth = prompt_tokens + eval_count // 2
        self.tokens += eval_count
        self.seconds += eval_seconds
        self.predicted_seconds += eval_count / max(1e-9, decode_at(curve, depth))
        self.depth_tokens += depth * eval_count

    @property
    def measured_tps(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def predicted_tps(self) -> float:
        return self.tokens / self.predicted_seconds if self.predicted_seconds else 0.0

    @property
    def ratio(self) -> float:
        """Measured seconds over predicted (above 1: slower than priced)."""
        return self.seconds / self.predicted_seconds if self.predicted_seconds else 1.0

    @property
    def depth(self) -> int:
        return self.depth_tokens // max(1, self.tokens)

    def off(self) -> str:
        """Why the plan should be priced again ("": it decodes as predicted, or too few tokens
        were measured to say)."""
        if self.tokens < MIN_CHECK_TOKENS or abs(self.ratio - 1.0) <= OFF_BY:
            return ""
        if self.ratio >= 2 or self.ratio <= 0.5:
            by = f"{max(self.ratio, 1 / self.ratio):.1f}x"
        else:
            by = f"{abs(self.ratio - 1):.0%}"
        way = "slower" if self.ratio > 1 else "faster"
        return (f"it decoded {self.measured_tps:.1f} tok/s over {self.tokens} tokens where its "
                f"plan predicted {self.predicted_tps:.1f} ({by} {way})")

    def report(self) -> dict:
        """For ps: the plan's predicted decode beside the measured, over the same answers."""
        return {"predicted_tps": round(self.predicted_tps, 2),
                "measured_tps": round(self.measured_tps, 2), "tokens": self.tokens,
                "off": self.off()}


def decode_at(curve: tuple[tuple[int, float], ...], depth: int) -> float:
    """A plan's (depth, tok/s) curve read at `depth`: straight lines between its points, the
    nearest end outside them."""
    points = sorted(curve)
    if depth <= points[0][0]:
        return points[0][1]
    for (d0, t0), (d1, t1) in zip(points, points[1:], strict=False):
        if depth <= d1:
            return t0 + (t1 - t0) * (depth - d0) / max(1, d1 - d0)
    return points[-1][1]


def has_host_part(plan: Plan, n_layer: int) -> bool:
    """Whether a GPU plan computes part of a step on the host (layers or experts in RAM) or
    reads missed experts from it: the ways whose prices serving corrects."""
    on_gpu = plan.n_gpu_layers != 0
    partial = 0 <= plan.n_gpu_layers <= n_layer or bool(plan.tensor_overrides)
    return on_gpu and (partial or plan.expert_misses_on_gpu)


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
        """A plan whose decode was far from its price (`check`: its DecodeCheck):
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

    def vram_served(self, plan: Plan, used: Callable[[], int | None], card: Callable) -> None:
        """After an answer: the runner's GPU memory (`used`: NVML's figure for its process,
        None without one) against what `plan` counted; this machine's GPU overhead raised by
        what it held beyond that (served_vram.py), for every later plan. `card`: this
        machine's card as the planner sees it (it probes: off the loop)."""
        def run() -> None:
            held = used()
            if held is None:
                return
            current = card().overhead_bytes
            overhead = served_vram.overhead_from(plan, held, current)
            if overhead is not None and served_vram.store(overhead, current):
                log.info("%s: its runner held %d MiB on the GPU where its plan counted %d: "
                         "this machine's GPU overhead is now %d MiB (what serving measured)",
                         self.model, held >> 20, served_vram.planned_gpu_bytes(plan) >> 20,
                         overhead >> 20)

        _write("the GPU overhead served", run)

    def way_measured(self, check: DecodeCheck) -> float:
        """The check's plan's way (planner/ways.py) decoded as `check` says: stored for the
        next plan, carried to the plan's own depth (its prediction over the check's ratio);
        returns that figure."""
        plan = check.plan
        tps = plan.predicted_decode_tps / check.ratio
        _write("the way's measured decode", ways.record, self.model, self.file_size,
               plan.ways_key, plan.way, tps, check.tokens)
        return tps

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
