"""Expert cache hit rates measured while serving, per model file, for the tuner (issue #40).

The tuner prices a pool of hot experts from a curve of hit rate against slots per served block
(planner/expert_pool.py): routing studies of real models until this model has been
served with a pool here, then what its pool really hit. After each answer the daemon stores
the runner's running totals since its load (hits, misses, evictions, steps) under the share of a
block's experts the pool held (slots / (blocks served x experts a block)); a load with fewer
lookups than the one stored for the same share does not replace it until it has MIN_LOOKUPS.
Stored in `<config dir>/profiles/expert_hits.toml`, one table per model. `tune --measure`
stores what its benchmark's pool hit the same way, decoding enough tokens for MIN_LOOKUPS.
"""

from __future__ import annotations

from pathlib import Path

from localllm.paths import unless_broken

from .saved import model_table, profiles_dir, read_tables, write_toml

MIN_LOOKUPS = 20_000  # a share's lookups before its rate replaces the assumed curve there
# How far a pool's measured hit rate may be from the one its plan was priced with before the
# daemon plans the model again (pool_far_from_its_price)
REPLAN_HIT_GAP = 0.15


def hits_file() -> Path:
    return profiles_dir() / "expert_hits.toml"


def record(model: str, file_size: int, share: float, hits: int, misses: int, evictions: int,
           steps: int, path: Path | None = None) -> None:
    """The pool's totals since its load at `share` of a block's experts held (`evictions`:
    swaps after it filled, `evicted`)."""
    if share <= 0 or hits + misses <= 0:
        return
    path = path or hits_file()
    doc = read_tables(path)
    entry = model_table(doc, model, file_size)
    key = f"{share:.4f}"
    before = 0
    with unless_broken(path, "the expert cache's hit record"):
        old = entry.get(key, {})
        before = int(old.get("hits", 0)) + int(old.get("misses", 0))
    if not path.exists():  # set aside: a fresh record
        doc, entry = {}, {"file_size": file_size}
    if hits + misses < MIN_LOOKUPS and before > hits + misses:
        return  # a new load's first answers: the longer record stands for now
    entry[key] = {"hits": hits, "misses": misses, "evictions": evictions, "steps": steps}
    doc[model] = entry
    write_toml(path, doc)


def record_pool(model: str, file_size: int, expert_count: int, pool,
                path: Path | None = None) -> None:
    """A pool's figures so far (`pool`: slots, layers, hits, misses, swaps, steps, as the
    runner's expert_cache event and engine/expert_cache.read give them) under the share of a
    block's experts it held; nothing for a pool that served no block."""
    if not pool.layers or not expert_count:
        return
    record(model, file_size, pool.slots / (pool.layers * expert_count), pool.hits,
           pool.misses, evicted(pool), pool.steps, path)


def evicted(pool) -> int:
    """The swaps that replaced an expert: the engine's count less the pool's first fill.
    Every slot is filled once (mostly while the first prompt is read, without a cap) and never
    freed, so a step's copies are the swaps past `slots`; counting the fill priced the 80B
    class's pool at 58 copies a step after its first answer where it made 9."""
    return max(0, pool.swaps - pool.slots)


def tokens_for_lookups(n_layer: int, experts_used: int) -> int:
    """Decoded tokens that give MIN_LOOKUPS lookups when every block's experts are pooled."""
    return -(-MIN_LOOKUPS // max(1, n_layer * experts_used))


def measured_hits(model: str, file_size: int, path: Path | None = None
                  ) -> tuple[tuple[float, float, float], ...]:
    """(share, hit rate, swaps a step) for each share this model file was served with long
    enough (MIN_LOOKUPS); () where none was."""
    entry = model_table(read_tables(path or hits_file()), model, file_size)
    out = []
    for key, counts in entry.items():
        if not isinstance(counts, dict):
            continue
        try:
            share = float(key)
            hits, misses = int(counts["hits"]), int(counts["misses"])
            # "swaps" in older records: the fill counted too
            swaps = int(counts.get("evictions", counts.get("swaps", 0)))
            steps = int(counts.get("steps", 0))
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError):
            continue
        if hits + misses >= MIN_LOOKUPS:
            out.append((share, hits / (hits + misses), swaps / max(steps, 1)))
    return tuple(sorted(out))


def pool_far_from_its_price(pool, plan, setting: int | str) -> str:
    """Why a loaded plan's expert pool should be priced again ("" where it should not):
    `expert_cache = auto` sized it from a hit rate (the prior curve, or an older measurement)
    that the pool (`pool`: its running hits and misses), over MIN_LOOKUPS lookups, missed by
    REPLAN_HIT_GAP or more either way. By then `record` has stored the measured rate, so the
    next plan is priced from it. An explicit pool size is the user's: never replanned."""
    if setting != "auto" or pool is None or not plan.expected_hit_rate:
        return ""
    lookups = pool.hits + pool.misses
    if lookups < MIN_LOOKUPS:
        return ""
    rate = pool.hits / lookups
    if abs(rate - plan.expected_hit_rate) < REPLAN_HIT_GAP:
        return ""
    return (f"its expert cache hit {rate:.0%} of {lookups} lookups where the plan assumed "
            f"{plan.expected_hit_rate:.0%}")
