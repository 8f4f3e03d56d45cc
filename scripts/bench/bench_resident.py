#!/usr/bin/env python3
"""Decode with every weight on the GPU: llama-bench beside the speed model's price, per shape.

    source .device-carry/on-device.sh
    python3 -m scripts.bench.bench_resident --shapes qwen35-35b-a3b,qwen3-next-80b-a3b \
        --experts 16 --kv f16,q8_0 --depths 0,16384,29480 --models /tmp/models --out $OUT

The parts of the speed model that are the GPU's own (a block's kernels by kind, attention at
depth by KV type, the lm-head) checked alone, without a pool, a CPU or the runner's loop in the
way: llama-bench's `tg` (batch-1 decode after `-d` tokens of context, flash attention, all
layers on the GPU) against `predict_speed` for the same file with everything on the GPU, less
the runner's own loop per token (speed.TOKEN_SECONDS), which llama-bench does not have.

`--experts N` writes each MoE shape with N experts a block instead of its real count, the
experts per token unchanged (synth_gguf.fewer_experts): the same decode step from a file a
tenth of the size. Both sides price and measure that file; `bench_session.py --experts N
--budget 100` runs it through the daemon. Prints one row per shape, KV type and depth
(measured, priced, the error and the priced parts) and appends them to $OUT/resident.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]



from scripts import synth_gguf  # noqa: E402

from localllm.modelstore.shape import read_shape  # noqa: E402
from localllm.planner import speed  # noqa: E402
from localllm.planner.card import load_card  # noqa: E402
from localllm.planner.costs import model_costs  # noqa: E402
from localllm.planner.memory import ContextSettings  # noqa: E402
from localllm.planner.placements import Placement  # noqa: E402


def priced(costs, kv: str, depth: int, ctx: int, card) -> dict:
    """The speed model's decode for a file's `costs` all on the GPU at `depth`, without the
    runner's loop, and its parts in ms a token."""
    settings = ContextSettings(n_ctx=ctx, type_k=kv, type_v=kv)
    everything = Placement(n_gpu_layers=costs.n_blocks + 1)
    s = speed.predict_speed(costs, everything, settings, card, depth=depth)
    engine = 1.0 / s.decode_tps - speed.TOKEN_SECONDS
    gpu_bw = speed.gpu_bandwidths(card)[card.gpu_list[0].device]
    blocks = [i for i in range(costs.n_blocks) if costs.block_bytes[i] or costs.expert_bytes[i]]
    attention = sum(speed.attention_seconds(costs, i, settings, depth, True, card, card.cores)
                    for i in blocks)
    weights = sum(costs.block_bytes[i] + costs.expert_bytes[i] * costs.expert_active_fraction
                  for i in blocks) / gpu_bw
    return {"priced_tps": round(1.0 / engine, 2), "priced_ms": round(engine * 1e3, 3),
            "parts_ms": {"launches": round(len(blocks) * speed.GPU_BLOCK_SECONDS * 1e3, 3),
                         "recurrent": round(sum(1 for i in blocks if costs.state_bytes[i])
                                            * speed.GPU_RECURRENT_BLOCK_SECONDS * 1e3, 3),
                         "weights": round(weights * 1e3, 3),
                         "attention": round(attention * 1e3, 3),
                         "lm_head": round(costs.output_bytes / gpu_bw * 1e3, 3)}}


def llama_bench(path: Path, kv: str, depths: list[int], tokens: int) -> dict[int, float]:
    """llama-bench tg tok/s at each depth, every layer on the GPU, flash attention."""
    cmd = ["llama-bench", "-m", str(path), "-ngl", "99", "-fa", "1", "-ctk", kv, "-ctv", kv,
           "-p", "0", "-n", str(tokens), "-d", ",".join(map(str, depths)), "-r", "2",
           "-o", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1:] or f"exit {done.returncode}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {int(r["n_depth"]): float(r["avg_ts"]) for r in rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="qwen35-35b-a3b,qwen3-next-80b-a3b")
    p.add_argument("--experts", type=int, default=16,
                   help="MoE shapes: experts a block in the file written (0: the real count)")
    p.add_argument("--kv", default="f16,q8_0")
    p.add_argument("--depths", default="0,16384,29480")
    p.add_argument("--ctx", type=int, default=32768, help="the context the model prices")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--card", default="h200")
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    if not shutil.which("llama-bench"):
        raise SystemExit("llama-bench is not on PATH: source .device-carry/on-device.sh first")
    card = load_card(args.card)
    depths = [int(d) for d in args.depths.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "resident.jsonl", "a") as jsonl:
        for name in args.shapes.split(","):
            config = synth_gguf.fewer_experts(synth_gguf.SHAPES[name], args.experts)
            path = synth_gguf.ensure_model(args.models, config)
            costs = model_costs(read_shape(path))
            for kv in args.kv.split(","):
                try:
                    measured = llama_bench(path, kv, depths, args.tokens)
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    measured, error = {}, str(e)
                else:
                    error = None
                for depth in depths:
                    row = {"shape": name, "file": path.name, "kv": kv, "depth": depth,
                           **priced(costs, kv, depth, args.ctx, card)}
                    if depth in measured:
                        tps = measured[depth]
                        row |= {"bench_tps": round(tps, 2), "bench_ms": round(1e3 / tps, 3),
                                "error": f"{row['priced_tps'] / tps - 1:+.1%}"}
                    elif error:
                        row["bench_error"] = error
                    jsonl.write(json.dumps(row) + "\n")
                    jsonl.flush()
                    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
