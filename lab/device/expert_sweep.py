"""On the GPU machine: llama-bench decode with the experts of the first k blocks in RAM, for a
fixture like tests/fixtures/h100-moe-prices.json, with this host's read rates and ggml's expert
kernel rates beside it (what a fresh daemon times on its first plan), so that one lease says
how well each prices the CPU's experts.

    python3 -m lab.device.expert_sweep --model M.gguf --out $R/expert-sweep.json

The rows: k in --blocks at depth 0 with all cores, k=24 at 16384, and k=24 at half the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from localllm.engine.kernel_rates import measure_kernel_gbs
from localllm.engine.probes import EXPERT_TYPES
from localllm.profiles.host_prices import measure_read_gbs, thread_counts


def bench(model: Path, k: int, threads: int, depth: int) -> float:
    cmd = ["llama-bench", "-m", str(model), "-ngl", "99", "-fa", "1", "-ctk", "q8_0", "-ctv",
           "q8_0", "-t", str(threads), "-p", "0", "-n", "64", "-d", str(depth), "-r", "2",
           "-o", "jsonl"]
    if k:
        blocks = "|".join(str(i) for i in range(k))
        cmd += ["-ot", rf"blk\.({blocks})\.ffn_(up|down|gate)_exps\.=CPU"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise SystemExit(f"llama-bench gave nothing for k={k}: {done.stderr[-400:]}")
    return round(rows[0]["avg_ts"], 2)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--blocks", default="0,12,24,36,48")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    counts = thread_counts(cores)
    rows = [{"k": k, "t": cores, "d": 0, "tps": bench(args.model, k, cores, 0)}
            for k in map(int, args.blocks.split(","))]
    rows.append({"k": 24, "t": cores, "d": 16384, "tps": bench(args.model, 24, cores, 16384)})
    rows.append({"k": 24, "t": cores // 2, "d": 0, "tps": bench(args.model, 24, cores // 2, 0)})
    doc = {"what": "llama-bench decode (tg64, -fa 1, q8_0 KV, -ngl 99) with the experts of the "
                   "first k blocks in RAM (-ot), t threads, depth d; the host's read rate and "
                   "ggml's expert kernel rates by threads (lab/device/expert_sweep.py)",
           "read_gbs": {str(t): g for t, g in measure_read_gbs(counts).items()},
           "expert_gbs": {name: {str(t): g for t, g in rates.items()}
                          for name, rates in
                          measure_kernel_gbs(list(EXPERT_TYPES), counts).items()},
           "decode": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
