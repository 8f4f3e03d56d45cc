"""A loaded plan's decode as it serves, against what the plan predicted (issue #65).

The speed model prices a placement from this machine's measured rates (host_prices.py, `tune
--calibrate`), but what a runner decodes at also turns on what no probe of the parts sees: how
llama.cpp's expert matmuls share the CPU's cores beside the GPU, the GPU's reads of missed
experts from pinned RAM under load, the runner's own loop. On an H100 lease a plan priced at
110 tok/s decoded 78, and `auto` had picked the slowest of three ways because two of its prices
were off in opposite directions.

So every answer's decode is added to its plan's `DecodeCheck` (served.py, which the daemon
runs after every answer). Once it says the plan is off, `blame` here lays the difference on the
part of a step that is priced rather than measured whole: the GPU's reads of missed experts
where the plan has them, else the host's seconds (weights, experts and attention the CPU
computes); `store` keeps that part's factor for this machine (calibration.toml's [host], applied
by calibration.calibrated). The daemon then plans the model again once it is idle
(scheduler.REPLAN_IDLE_S): with the factor the planner may pick another way (experts on the CPU
or a pool, misses on the CPU or the GPU), whose own decode is checked in turn. A plan with
nothing priced on the host (every weight on the GPU) is reported, not re-planned: no other way
there runs faster.
"""

from __future__ import annotations

import time
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

# A part of a step smaller than this share cannot carry the error: laid on it, its factor
# would swing past any real price (and the GPU's own part is measured well: see speed.py).
MIN_PART_SHARE = 0.2


def blame(check, shape, card: Card, pool=None) -> tuple[str, float] | None:
    """The Card field (served_host_factor or served_mapped_factor) whose price the check's (a
    served.DecodeCheck's) error is laid on and its new value, or None where no priced part is
    big enough to carry it (see MIN_PART_SHARE). `pool`: the runner's expert pool figures (its
    hit rate measured, where it has one), so that a pool's hit rate is not mistaken for a
    price."""
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
