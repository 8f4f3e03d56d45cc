"""A loaded plan's decode as it serves, against what the plan predicted (issue #65).

The speed model prices a placement from this machine's measured rates (host_prices.py, `tune
--calibrate`), but what a runner decodes at also turns on what no probe of the parts sees: how
llama.cpp's expert matmuls share the CPU's cores beside the GPU, the GPU's reads of missed
experts from pinned RAM under load, the runner's own loop. On an H100 lease a plan priced at
110 tok/s decoded 78, and `auto` had picked the slowest of three ways because two of its prices
were off in opposite directions.

So every answer's decode is added to its plan's `DecodeCheck`: the seconds it took against the
seconds the plan's curve gives at the answer's depth. Once MIN_CHECK_TOKENS tokens are in and
the two differ by more than OFF_BY, `blame` lays the difference on the part of a step that is
priced rather than measured whole: the GPU's reads of missed experts where the plan has them,
else the host's seconds (weights, experts and attention the CPU computes); `store` keeps that
part's factor for this machine (calibration.toml's [host], applied by calibration.calibrated).
The daemon then plans the model again once it is idle (scheduler.REPLAN_IDLE_S): with the
factor the planner may pick another way (experts on the CPU or a pool, misses on the CPU or the
GPU), whose own decode is checked in turn. A plan with nothing priced on the host (every
weight on the GPU) is reported, not re-planned: no other way there runs faster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from localllm.planner.card import Card
from localllm.planner.costs import model_costs
from localllm.planner.expert_pool import pool_shape
from localllm.planner.memory import block_devices
from localllm.planner.placements import in_ram
from localllm.planner.plan import Plan
from localllm.planner.speed import ExpertPool, predict_speed, pool_hits

from .calibration import SERVED_FACTOR_RANGE, SERVED_FROM_KEY, SERVED_WHEN_KEY, update_host
from .choose import placement_of, settings_of

MIN_CHECK_TOKENS = 96  # decoded tokens before a plan is judged: a few answers, not one
MIN_ANSWER_TOKENS = 8  # an answer shorter than this times its first steps, not decode
OFF_BY = 0.15  # how far measured decode may be from the prediction before it is priced again
# A part of a step smaller than this share cannot carry the error: laid on it, its factor
# would swing past any real price (and the GPU's own part is measured well: see speed.py).
MIN_PART_SHARE = 0.2


@dataclass
class DecodeCheck:
    """Decode measured while serving `plan`, against its predicted curve: answers that ran
    alone on the runner, without drafting (the scheduler decides which count)."""

    plan: Plan
    tokens: int = 0
    seconds: float = 0.0
    predicted_seconds: float = 0.0
    depth_tokens: int = 0  # sum of each answer's middle depth x its tokens

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


def blame(check: DecodeCheck, shape, card: Card, pool=None) -> tuple[str, float] | None:
    """The Card field (served_host_factor or served_mapped_factor) whose price the check's
    error is laid on and its new value, or None where no priced part is big enough to carry it
    (see MIN_PART_SHARE). `pool`: the runner's expert pool figures (its hit rate measured,
    where it has one), so that a pool's hit rate is not mistaken for a price."""
    plan = check.plan
    costs = model_costs(shape)
    placement = placement_of(plan, shape)
    priced_pool = pool_as_served(plan, shape, costs, placement, card, pool)
    speed = predict_speed(costs, placement, settings_of(plan), card, plan.n_threads,
                          min(check.depth, plan.n_ctx), pool=priced_pool)
    predicted = 1.0 / speed.decode_tps  # with the factors in use now
    measured = check.seconds / max(1, check.tokens)
    for field, part in (("served_mapped_factor", speed.decode_seconds_mapped),
                        ("served_host_factor", speed.decode_seconds_cpu)):
        if part >= MIN_PART_SHARE * predicted:
            low, high = SERVED_FACTOR_RANGE
            needed = max(part + measured - predicted, part * low)
            return field, round(min(high, max(low, getattr(card, field) * needed / part)), 3)
    return None


def pool_as_served(plan: Plan, shape, costs, placement, card: Card, pool) -> ExpertPool | None:
    """The plan's expert pool as decode prices it, at the hit rate the runner measured (its
    figures, `pool`) or else the one the plan was priced with; None without a pool."""
    shape_of_pool = pool_shape(shape)
    if not plan.expert_cache or shape_of_pool is None:
        return None
    hit_rate = pool.hit_rate if pool is not None and pool.hits + pool.misses else \
        plan.expected_hit_rate
    devices = block_devices(costs, placement, card.n_gpus if card.has_gpu else 0)
    probe = ExpertPool(plan.expert_cache, shape_of_pool.n_expert,
                       frozenset(shape_of_pool.blocks), ((0.5, 0.5),),
                       misses_on_gpu=plan.expert_misses_on_gpu)
    served, _ = pool_hits(costs, devices, in_ram(costs, placement), probe)
    if not served:
        return None
    share = plan.expert_cache / (len(served) * shape_of_pool.n_expert)
    return ExpertPool(plan.expert_cache, shape_of_pool.n_expert, frozenset(served),
                      ((min(share, 0.999), hit_rate),), misses_on_gpu=plan.expert_misses_on_gpu)


def store(field: str, factor: float, model: str, path: Path | None = None) -> None:
    """Keep a served-speed factor for this machine (calibration.toml's [host]), with when and
    on which model it was measured (`tune --json` names it as the price's source)."""
    update_host({field: factor, SERVED_WHEN_KEY: time.strftime("%Y-%m-%dT%H:%M:%S"),
                 SERVED_FROM_KEY: model}, path)
