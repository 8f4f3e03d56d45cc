"""What the tuner plans and predicts for a synthetic MoE shape on a card with a VRAM budget,
with the expert cache sized by `auto`: its slots, where its misses go, the hit rate it was
priced with, and decode by depth; from the prior hit curve, or from a measured hit rate.

    python -m lab.analyses.pool_predictions qwen3-next-80b-a3b --card h200 --budget 12 \
        [--hit 0.63] [--misses auto|cpu|gpu] [--slots N]

The same plan a daemon on that card makes with default settings at a 32K context, where the
budget is emulated as bench_session.py does (vram_margin_mib = free - budget + 128 MiB). A
measured rate stands for the pool's own share (slots over served blocks' experts), as the
daemon keeps it after serving (localllm/profiles/expert_hits.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from scripts import synth_gguf

from localllm.modelstore.shape import read_shape
from localllm.planner.card import GIB, load_card
from localllm.planner.expert_pool import AUTO_SLOTS, blocks_in_ram, pool_shape
from localllm.planner.search import Request
from localllm.planner.tuner import tune

MIB = 1 << 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=tuple(synth_gguf.SHAPES))
    p.add_argument("--card", default="h200")
    p.add_argument("--budget", type=float, default=12, metavar="GiB")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--hit", type=float, help="the pool's measured hit rate")
    p.add_argument("--misses", default="auto", choices=("auto", "cpu", "gpu"))
    p.add_argument("--slots", type=int, default=AUTO_SLOTS,
                   help="a pool of this many slots (expert_cache = N; default: auto sizes it)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        header = synth_gguf.write_gguf(Path(tmp) / "m.gguf", synth_gguf.SHAPES[args.shape],
                                       "Q4_0", "sparse")
        shape = read_shape(header)
    card = load_card(args.card)
    margin = card.gpu_list[0].free_vram_bytes - int(args.budget * GIB) + 128 * MIB
    request = Request(n_ctx=args.ctx, margin_bytes=margin, expert_cache=args.slots,
                      expert_misses=args.misses)
    plan = tune(shape, card, request)
    if args.hit is not None and plan.expert_cache:
        pool = pool_shape(shape)
        share = plan.expert_cache / (len(blocks_in_ram(plan, shape, pool)) * pool.n_expert)
        measured = ((round(share, 4), args.hit, 1.0),)
        plan = tune(shape, card, replace(request, measured_hits=measured))
    print(f"{args.shape} on {args.card} at {args.budget:g} GiB, {args.ctx} context: "
          f"{plan.expert_cache} slots, misses on the "
          f"{'GPU' if plan.expert_misses_on_gpu else 'CPU'}, priced at "
          f"{plan.expected_hit_rate:.0%} hits ({'measured' if args.hit is not None else 'prior'})")
    for depth, tps in plan.predicted_decode_by_depth:
        print(f"  decode at {depth} tokens: {tps:.1f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
