#!/usr/bin/env python3
"""Weights in RAM on a GPU: copied into pinned memory (load_mode none), left in the file's
mapped pages, or mapped and pinned in place (engine/host_pin.py). Per way: the load's time, the
pinning's, a long prompt's reading and decode after it, each in a fresh process.

    source .device-carry/on-device.sh
    python3 -m lab.analyses.check_host_pin MODEL.gguf --cpu-expert-blocks 24 --ctx 32768 \
        --ubatch 2048 --prompt 16384 --threads 16 > $OUT/host-pin.jsonl

One JSON line per way.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


WAYS = ("copied", "mapped", "pinned-in-place")


def measure(args: argparse.Namespace) -> dict:
    import random

    import llama_cpp
    from localllm.engine.host_pin import pin_mapped
    from localllm.engine.model import free, load
    from localllm.planner.plan import Plan, TensorOverride

    blocks = "|".join(str(b) for b in range(args.cpu_expert_blocks))
    plan = Plan(n_ctx=args.ctx, n_gpu_layers=999, tensor_overrides=(TensorOverride(
        rf"^blk\.({blocks})\.ffn_(up|down|gate|gate_up)_exps\.", "CPU"),),
        type_k="q8_0", type_v="q8_0", flash_attn=True, n_batch=args.ubatch,
        n_ubatch=args.ubatch, n_threads=args.threads, n_threads_batch=args.threads,
        use_mmap=args.way != "copied")
    row: dict = {"way": args.way}
    t0 = time.monotonic()
    lm = load(args.model, plan)
    row["load_s"] = round(time.monotonic() - t0, 2)
    pinned = None
    if args.way == "pinned-in-place":
        t0 = time.monotonic()
        pinned = pin_mapped(args.model)
        row["pin_s"] = round(time.monotonic() - t0, 2)
        row["pinned_mib"] = pinned.pinned_bytes >> 20
        row["pin_error"] = pinned.error
    rng = random.Random(1)
    tokens = [rng.randrange(100, 30000) for _ in range(args.prompt)]
    t0 = time.monotonic()
    for i in range(0, len(tokens), args.ubatch):
        chunk = tokens[i:i + args.ubatch]
        arr = (llama_cpp.llama_token * len(chunk))(*chunk)
        assert llama_cpp.llama_decode(lm.ctx, llama_cpp.llama_batch_get_one(arr, len(chunk))) == 0
    llama_cpp.llama_synchronize(lm.ctx)
    row["prompt_tps"] = round(len(tokens) / (time.monotonic() - t0), 1)
    t0 = time.monotonic()
    for _ in range(args.decode):
        arr = (llama_cpp.llama_token * 1)(rng.randrange(100, 30000))
        assert llama_cpp.llama_decode(lm.ctx, llama_cpp.llama_batch_get_one(arr, 1)) == 0
    llama_cpp.llama_synchronize(lm.ctx)
    row["decode_tps"] = round(args.decode / (time.monotonic() - t0), 1)
    if pinned is not None:
        pinned.release()
    t0 = time.monotonic()
    free(lm)
    row["free_s"] = round(time.monotonic() - t0, 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--cpu-expert-blocks", type=int, default=24)
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--ubatch", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--decode", type=int, default=48)
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--way", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.way:
        print(json.dumps(measure(args)), flush=True)
        return
    for way in args.ways.split(","):
        out = subprocess.run([sys.executable, "-m", "lab.analyses.check_host_pin", *sys.argv[1:],
                              "--way", way],
                             capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1:] or [""]
        print(line[0] if out.returncode == 0 else json.dumps(
            {"way": way, "error": out.returncode, "tail": out.stderr[-800:]}), flush=True)


if __name__ == "__main__":
    main()
