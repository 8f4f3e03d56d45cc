"""The running plan's decode priced at its expert pool's measured hit rate (issue #37): what
/api/stats shows beside the plan's own curve once the pool has served MIN_LOOKUPS lookups.
The same placement and settings as loaded; only the hit rate and the copies a step are the
pool's own (expert_hits.py), in place of the ones the plan was priced with."""

from __future__ import annotations

from localllm.planner.costs import model_costs
from localllm.planner.expert_pool import PoolShape, pool_shape, priced_pool
from localllm.planner.search import Request
from localllm.planner.speed import ExpertPool, predict_speed
from .choose import placement_of, settings_of
from .expert_hits import MIN_LOOKUPS, evicted


def decode_at_measured_hits(plan, shape, card, pool) -> tuple[tuple[int, float], ...]:
    """The running plan's decode at the start, middle and end of its context, its expert pool
    priced at the hit rate and swaps a step measured so far (`pool`: the runner's figures)
    instead of the rate the plan was priced with: the same placement and settings, only the
    hits known. () before MIN_LOOKUPS lookups, and where the plan's decode is not priced that
    way alone: no pool, drafting, weights read from disk."""
    shape_of_pool = pool_shape(shape)
    if (pool is None or shape_of_pool is None or not plan.expert_cache or not pool.layers
            or pool.hits + pool.misses < MIN_LOOKUPS or plan.speculative != "off"
            or plan.streamed_bytes):
        return ()
    priced = measured_pool(shape_of_pool, pool.slots, pool.layers, pool.hit_rate,
                           evicted(pool) / max(pool.steps, 1), plan.expert_misses_on_gpu)
    costs, placement, settings = model_costs(shape), placement_of(plan, shape), settings_of(plan)
    return tuple((depth, round(predict_speed(costs, placement, settings, card, plan.n_threads,
                                             depth, pool=priced).decode_tps, 2))
                 for depth in (0, plan.n_ctx // 2, plan.n_ctx))


def measured_pool(shape_of_pool: PoolShape, slots: int, layers: int, hit_rate: float,
                  copies_a_step: float, misses_on_gpu: bool) -> ExpertPool:
    """A pool of `slots` over `layers` served blocks as decode prices it at a measured hit rate
    and copies a step (scripts/bench/reprice_runs.py prices recorded runs with it too)."""
    share = slots / (layers * shape_of_pool.n_expert)
    return priced_pool(shape_of_pool, slots,
                       Request(measured_hits=((share, hit_rate, copies_a_step),)), misses_on_gpu)
