"""Which way `auto` runs an MoE model whose experts do not all fit in VRAM, where the prices of
its ways are too close to trust (issue #65).

The ways: no pool (the CPU computes the experts in RAM), a pool of hot experts on the GPU with
its misses computed by the CPU, or with its misses read by the GPU from pinned RAM
(expert_pool.py prices each). On an H100 host at 12 GiB the speed model priced Qwen3-30B-A3B's
pool with GPU misses at 122 tok/s, misses on the CPU at 80 and no pool at 70; they decoded 89,
116 and 116. Its errors run both ways, so a price within DOUBT of the best proves nothing.

So a way priced within DOUBT of the fastest is in doubt, and the price alone decides only until
one of them has been measured: the daemon runs the way priced fastest first, stores what it
decoded serving (profiles/ways.py, per machine, model file, budget and context), plans again
between requests, and is given the unmeasured way priced fastest next (`choose`); once every
way in doubt was measured the fastest measured is kept, and a later load takes it at once.
`after_measuring` says, from a running plan's table, whether another load is due.
"""

from __future__ import annotations

from collections.abc import Mapping

from .card import GIB, Card
from .plan import Plan

# A way priced at this share of the fastest way's decode or more is measured before either is
# kept: the H100's prices were off by 1.37x one way and 1.45-1.66x the other (0.7 x 0.7).
DOUBT = 0.5
# A measured way this much faster than the running one is worth a reload; closer is noise.
WORTH_A_RELOAD = 1.05
WORDS = {"no-pool": "no pool (the CPU computes the experts in RAM)",
         "pool-cpu": "a pool on the GPU, its misses computed by the CPU",
         "pool-gpu": "a pool on the GPU, its misses read by the GPU from RAM"}


def way_of(plan: Plan) -> str:
    """The way a plan runs its experts (WORDS)."""
    return pool_way(plan.expert_misses_on_gpu) if plan.expert_cache else "no-pool"


def pool_way(misses_on_gpu: bool) -> str:
    """The way of a pool whose misses the GPU (or else the CPU) computes."""
    return "pool-gpu" if misses_on_gpu else "pool-cpu"


def situation(card: Card, margin_bytes: int, n_ctx: int, threads: int) -> str:
    """What ways are measured under: this card with this much VRAM to plan in (its free VRAM
    less the margin kept free, to a half GiB, so that a probe's few MiB of drift keep it), at
    this context, the CPU's share decoded with this many threads (a way measured with other
    threads is measured again)."""
    budget = card.gpu_list[0].free_vram_bytes - margin_bytes if card.has_gpu else 0
    return f"{card.name}, {round(budget / GIB * 2) / 2:g} GiB, ctx {n_ctx}, {threads} threads"


def choose(priced: Mapping[str, Plan], by_price: str, measured: Mapping[str, float]
           ) -> tuple[str, str, tuple[tuple[str, float, float], ...]]:
    """The way to run (a key of `priced`, each way's fastest plan), why in words ("": one way
    is not in doubt), and the table of the ways in doubt: (way, predicted tok/s, measured tok/s
    or 0), fastest priced first. `by_price`: the way the prices pick; `measured`: each way's
    decode measured here (profiles/ways.py)."""
    fastest = max(p.predicted_decode_tps for p in priced.values())
    doubt = sorted((w for w, p in priced.items() if p.predicted_decode_tps >= DOUBT * fastest),
                   key=lambda w: -priced[w].predicted_decode_tps)
    if len(doubt) < 2 or by_price not in doubt:
        return by_price, "", ()
    table = tuple((w, round(priced[w].predicted_decode_tps, 1), round(measured.get(w, 0.0), 1))
                  for w in doubt)
    listed = "; ".join(_line(row) for row in table)
    unmeasured = [w for w in doubt if w not in measured]
    if len(unmeasured) == len(doubt):
        return by_price, (f"ways priced too close to trust the price ({listed}): the one "
                          "the prices pick first, the others measured while serving"), table
    if unmeasured:
        return unmeasured[0], (f"ways priced too close to trust the price ({listed}): the "
                               f"unmeasured one priced fastest, measured next"), table
    best = max(doubt, key=lambda w: measured[w])
    return best, f"ways measured on this machine ({listed}): the fastest kept", table


def after_measuring(plan: Plan, measured_tps: float) -> str:
    """Why a plan whose way just decoded `measured_tps` should be planned again ("": it should
    not): another way in its table is not measured yet, or one measured is faster."""
    others = [row for row in plan.ways if row[0] != plan.way]
    if not others or not plan.way:
        return ""
    here = f"{WORDS.get(plan.way, plan.way)} decoded {measured_tps:.1f} tok/s"
    unmeasured = [w for w, _, tps in others if not tps]
    if unmeasured:
        return f"{here}; {WORDS.get(unmeasured[0], unmeasured[0])} is measured next"
    way, _, tps = max(others, key=lambda row: row[2])
    if tps > measured_tps * WORTH_A_RELOAD:
        return f"{here} where {WORDS.get(way, way)} decoded {tps:.1f}: that way is loaded"
    return ""


def _line(row: tuple[str, float, float]) -> str:
    way, predicted, tps = row
    return f"{way} priced {predicted:.1f} tok/s" + (f", measured {tps:.1f}" if tps else "")
