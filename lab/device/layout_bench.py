"""On the GPU machine, after a bench_session run: llama-bench on the placement the daemon ran,
so that one lease tells the runner's own cost apart from the host's.

    python3 -m lab.device.layout_bench --session $OUT/session.jsonl --model M.gguf --out $OUT

For each distinct placement an `ours*` system of the session ran (its `running` field: GPU
layers, KV type, threads, the tensors kept in RAM), `llama-bench -p 0 -n 64 -r 2` at depth 0
and 16384 with the same `-ngl`, `-ot`, `-t`, `-ctk/-ctv` and flash attention; the figures go to
$OUT/layout_bench.jsonl beside what the daemon decoded with that placement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path


def placements(session: Path) -> list[dict]:
    """The distinct `running` placements of the session's ours* rows, with what each decoded
    (run name -> tok/s, the prediction beside it)."""
    seen: dict[str, dict] = {}
    for line in session.read_text().splitlines():
        row = json.loads(line)
        running = row.get("running")
        if not running or not str(row.get("system", "")).startswith("ours"):
            continue
        key = json.dumps(running, sort_keys=True)
        entry = seen.setdefault(key, {"running": running, "system": row["system"], "ours": []})
        entry["ours"].append({k: row.get(k) for k in ("run", "decode_tps", "predicted_decode_tps",
                                                      "prompt_tokens")})
    return list(seen.values())


def bench_args(running: dict) -> list[str]:
    k, _, v = running.get("kv_type", "f16").partition("/")
    args = ["-ngl", str(running.get("gpu_layers", 99)), "-fa", "1", "-ctk", k, "-ctv", v or k,
            "-t", str(running.get("n_threads", 16))]
    overrides = [f"{pattern}=CPU" for pattern in running.get("cpu_overrides", [])]
    if overrides:
        args += ["-ot", ",".join(overrides)]
    return args


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--session", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--depths", default="0,16384")
    args = p.parse_args()
    with open(args.out / "layout_bench.jsonl", "a") as out:
        for placement in placements(args.session):
            cmd = ["llama-bench", "-m", str(args.model), "-p", "0", "-n", "64", "-r", "2",
                   "-d", args.depths, "-o", "jsonl", *bench_args(placement["running"])]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            rows = [json.loads(line) for line in done.stdout.splitlines()
                    if line.startswith("{")]
            figures = [{"depth": r.get("n_depth"), "tps": round(r.get("avg_ts", 0.0), 2)}
                       for r in rows]
            result = {**placement, "cmd": " ".join(cmd), "llama_bench": figures,
                      **({"stderr": done.stderr[-2000:]} if done.returncode else {})}
            out.write(json.dumps(result) + "\n")
            out.flush()
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
