#!/usr/bin/env python3
"""Recorded H200 runs of the daemon priced again by today's speed model, each at the hit rate
its expert pool measured in that run: how far the model is from what was measured.

    python -m scripts.bench.reprice_runs lab/runs/h200-2026-12-03-round11.jsonl \
        lab/runs/h200-2026-12-03-round12.jsonl

Reads bench_session.py's rows of system `ours` (decode after a short prompt, after a 16K
prompt, after 90% of the context). A run's placement is rebuilt from its rows: the plan's
gpu_layers and KV type, and the experts of the pool's served blocks (the first `layers`
blocks) in RAM, as the daemon plans an expert cache; its hits, misses and swaps are the
differences of the pool's totals before and after the run. A run in a fill band runs the
band's plan: its context is the band's, and its placement and KV type the row's `running`
(rows from 2026-12-03's last runs on; before, the first plan's).
tests/test_speed_recorded.py holds the model to these runs, so that a constant changed for one
shape cannot quietly break the others.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path


from scripts import synth_gguf

from localllm.modelstore.shape import read_shape
from localllm.planner.card import load_card
from localllm.planner.costs import model_costs
from localllm.planner.expert_pool import pool_shape
from localllm.planner.memory import ContextSettings
from localllm.planner.placements import Placement
from localllm.planner.speed import predict_speed
from localllm.profiles.pool_price import measured_pool

RUNS = ("short", "prompt", "deep")


@dataclass(frozen=True)
class Run:
    label: str
    measured_tps: float
    priced_tps: float

    @property
    def error(self) -> float:
        return self.priced_tps / self.measured_tps - 1


@cache
def _shape(shape: str, experts: int):
    config = synth_gguf.fewer_experts(synth_gguf.SHAPES[shape], experts)
    with tempfile.TemporaryDirectory() as tmp:
        return read_shape(synth_gguf.write_gguf(Path(tmp) / "m.gguf", config, "Q4_0", "sparse"))


def runs(rows: list[dict], card_name: str = "h200") -> list[Run]:
    """Each recorded decode of ours, measured and priced."""
    card = load_card(card_name)
    out, plan, before = [], {}, None
    for row in rows:
        if row.get("system") != "ours":
            continue
        if "plan" in row:  # a new daemon: its plan, a pool not yet used
            plan = dict(re.findall(r"(gpu_layers|kv_type) (\w+)", row["plan"]))
            before = None
            continue
        if row.get("run") not in RUNS or "decode_tps" not in row:
            continue
        ran = {**plan, **row.get("running", {})}  # the plan that ran, where the row says it
        n_ctx = ran.get("n_ctx") or (row.get("band") or {}).get("n_ctx") or row["ctx"]
        pool = row.get("expert_cache")
        shape = _shape(row["shape"], row.get("experts", 0))
        costs = model_costs(shape)
        settings = ContextSettings(n_ctx=int(n_ctx), type_k=ran["kv_type"],
                                   type_v=ran["kv_type"])
        placement = Placement(int(ran["gpu_layers"]),
                              n_cpu_expert_layers=pool["layers"] if pool else 0)
        priced = None
        if pool and before and (pool["hits"] < before["hits"]
                                or pool["layers"] != before["layers"]):
            before = None  # a fill band's new context: a new pool, its counts from zero
        if pool:
            hits = pool["hits"] - (before or {}).get("hits", 0)
            misses = pool["misses"] - (before or {}).get("misses", 0)
            steps = pool["steps"] - (before or {}).get("steps", 0)
            # the first run's swaps include the pool's one-time fill of every slot
            swaps = pool["swaps"] - (before["swaps"] if before else pool["slots"])
            priced = measured_pool(pool_shape(shape), pool["slots"], pool["layers"],
                                   hits / max(1, hits + misses), max(0, swaps) / max(1, steps),
                                   pool.get("misses_on") == "gpu")
            before = pool
        depth = row.get("prompt_tokens", 60)
        threads = int(ran.get("n_threads") or card.cores)
        # runs recorded before patch 0007 (no "attention" field) ran the per-head kernel
        tps = predict_speed(costs, placement, settings, card, threads, depth, pool=priced,
                            grouped_attention=row.get("attention") == "grouped").decode_tps
        label = (f"{row.get('lease', '')} {row['shape']}"
                 f"{'-e' + str(row['experts']) if row.get('experts') else ''}"
                 f" {row['run']} at {depth}")
        out.append(Run(label.strip(), row["decode_tps"], tps))
    return out


def read_rows(paths) -> list[dict]:
    return [json.loads(line) for path in paths for line in Path(path).read_text().splitlines()
            if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="bench_session.py's session.jsonl rows")
    p.add_argument("--card", default="h200")
    args = p.parse_args(argv)
    for run in runs(read_rows(args.files), args.card):
        print(f"{run.label:48s} measured {run.measured_tps:7.2f}  priced {run.priced_tps:7.2f}"
              f"  {run.error:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
