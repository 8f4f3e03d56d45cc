"""Benchmark: a model split over two `localllm worker`s (RPC, loopback) by localllm's planner,
against llama.cpp's own split over the same two workers.

    python -m scripts.bench.bench_rpc                                # GPU machine: 27B-class model
    python -m scripts.bench.bench_rpc --model .cache/test-models/SmolLM2-135M-Instruct.Q4_1.gguf

With two or more NVIDIA GPUs each worker gets one (CUDA_VISIBLE_DEVICES, `--device cuda0`);
otherwise both lend the CPU. The measuring process sees no GPU itself, so every layer runs on
a worker. Rows, each its own process (a worker serves one client at a time):
  - localllm: `choose_plan` with rpc_workers set (probe, planner), model and context built
    from the plan as the runner builds them; prompt then decode timed over a bare
    llama_decode loop (localllm/engine/measure.py);
  - llama.cpp split: the same load with tensor_split left to llama.cpp (by free memory);
  - llama-bench --rpc: llama.cpp's own tool over the same workers, when it is on PATH;
  - alone: one device without RPC (the first GPU, or this CPU), for the network's cost.
Prints a table and writes bench_rpc.json and bench_rpc.md to $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
START_DIR = Path.cwd()  # where relative paths given on the command line are



SYNTH_SHAPE = "dense-27b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def start_worker(index: int, use_gpu: bool, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    args = [sys.executable, "-m", "localllm.cli", "worker", "--port", str(port)]
    if use_gpu:
        env["CUDA_VISIBLE_DEVICES"] = str(index)
        args += ["--device", "cuda0"]
    else:
        args += ["--device", "cpu", "--threads", str(threads)]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"127.0.0.1:{port}"
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"worker {index} exited: {proc.stdout.read()}") from None
            time.sleep(0.2)
    raise SystemExit(f"worker {index} did not listen within 120 s")


# ---- one measurement, in a child process ------------------------------------------------------

def measure(request: dict) -> dict:
    import llama_cpp  # noqa: F401  (before numpy: the CUDA build needs this order)
    from dataclasses import replace

    from localllm.engine import measure as bare_loop
    from localllm.modelstore.shape import read_shape
    from localllm.options import LoadOptions
    from localllm.profiles.choose import choose_plan
    from localllm.engine.hardware import host_card
    from localllm.planner.plan import Plan, physical_cores
    from localllm.engine.probes import Measure

    n_ctx = request["prompt"] + request["tokens"] + 64
    shape = read_shape(request["model"])
    predicted = None
    if request["kind"] == "alone":
        plan = Plan(n_ctx=n_ctx, n_gpu_layers=999 if request["gpu"] else 0,
                    n_threads=physical_cores(), n_threads_batch=physical_cores(),
                    flash_attn=request["gpu"])
        split = "all on " + ("GPU 0" if request["gpu"] else "the CPU")
    else:
        # NVML sees every GPU whatever CUDA_VISIBLE_DEVICES says: plan for this host alone.
        # CPU workers on this same machine are no faster than its RAM, and the planner would
        # leave them out: num_gpu asks for every layer on them.
        options = LoadOptions() if request["gpu"] else LoadOptions(num_gpu=999)
        plan = choose_plan(shape, "bench", n_ctx, options, card=host_card())
        if not plan.rpc_workers:
            raise SystemExit("the planner did not use the workers: " + "; ".join(plan.reasons))
        predicted = plan.predicted_decode_tps
        split = ", ".join(f"{d} {n}" for d, n in plan.device_layers if n)
        if request["kind"] == "llama.cpp":
            plan = replace(plan, tensor_split=(), n_gpu_layers=999)
            split, predicted = "llama.cpp: by free memory", None
    t0 = time.perf_counter()
    # The model and context built from the plan as the runner builds them, then a bare
    # llama_decode loop: a prompt read, a greedy decode (engine/measure.py, as tune --measure).
    result = bare_loop.run(Measure(request["model"], plan, request["prompt"], request["tokens"]))
    return {"row": request["kind"], "split": split,
            "load_and_run_s": round(time.perf_counter() - t0, 1),
            "prefill_tps": round(result.prefill_tps, 1),
            "decode_tps": round(result.decode_tps, 2),
            "predicted_decode_tps": predicted}


def run_child(request: dict, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "scripts.bench.bench_rpc", "--child",
                           json.dumps(request)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        return {"row": request["kind"], "error": tail or f"exit {done.returncode}"}
    return json.loads(lines[-1])


def llama_bench(model: str, endpoints: list[str], prompt: int, tokens: int, env: dict) -> dict:
    exe = shutil.which("llama-bench")
    if not exe:
        return {"row": "llama-bench --rpc", "error": "llama-bench is not on PATH"}
    args = [exe, "-m", model, "--rpc", ",".join(endpoints), "-ngl", "99", "-p", str(prompt),
            "-n", str(tokens), "-r", "2", "-o", "json"]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    try:
        results = json.loads(done.stdout)
    except ValueError:
        return {"row": "llama-bench --rpc", "error": done.stderr.strip().splitlines()[-1:]}
    row = {"row": "llama-bench --rpc", "split": "llama.cpp: by free memory"}
    for r in results:
        key = "prefill_tps" if r.get("n_prompt") else "decode_tps"
        row[key] = round(float(r["avg_ts"]), 2)
    return row


def table(rows: list[dict]) -> str:
    head = ["row", "split (layers)", "prefill tok/s", "decode tok/s", "predicted decode"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error']} | | | |")
            continue
        lines.append(f"| {r['row']} | {r.get('split', '')} | {r.get('prefill_tps', '')} | "
                     f"{r.get('decode_tps', '')} | {r.get('predicted_decode_tps') or ''} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help=f"GGUF to run (default: a synthetic {SYNTH_SHAPE} Q4_0)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (512)")
    p.add_argument("--tokens", type=int, default=128, help="decoded tokens (128)")
    p.add_argument("--threads", type=int, default=0, help="threads of a CPU worker")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))), flush=True)
        return 0

    model = str(START_DIR / args.model) if args.model else None
    if not model:
        model = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"{SYNTH_SHAPE}-q4_0.gguf")
        if not os.path.exists(model):
            print(f"writing {model} (synthetic {SYNTH_SHAPE}, random Q4_0 weights)...",
                  flush=True)
            subprocess.run([sys.executable, "-m", "scripts.synth_gguf",
                            SYNTH_SHAPE, model, "--type", "Q4_0", "--fill", "random"],
                           cwd=ROOT, check=True)
    gpus = gpu_count()
    use_gpu = gpus >= 2
    threads = args.threads or max(1, (os.cpu_count() or 2) // 4)
    workers = [start_worker(i, use_gpu, threads) for i in range(2)]
    endpoints = [ep for _, ep in workers]
    print(f"workers: {', '.join(endpoints)} ({'one GPU each' if use_gpu else 'CPU'}); "
          f"model {model}", flush=True)
    client = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "LOCALLLM_RPC_WORKERS":
              ",".join(endpoints)}
    base = {"model": model, "prompt": args.prompt, "tokens": args.tokens, "gpu": use_gpu}
    rows = []
    try:
        for kind in ("localllm", "llama.cpp"):
            rows.append(run_child({**base, "kind": kind}, client))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        rows.append(llama_bench(model, endpoints, args.prompt, args.tokens, client))
    finally:
        for proc, _ in workers:
            proc.kill()
            proc.wait()
    alone_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0" if gpus else ""}
    rows.append(run_child({**base, "kind": "alone", "gpu": gpus > 0}, alone_env))
    text = table(rows)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "bench_rpc.json").write_text(json.dumps(
            {"model": model, "workers": "gpu" if use_gpu else "cpu", "rows": rows}, indent=2))
        Path(out, "bench_rpc.md").write_text(text + "\n")
    return 0 if not any("error" in r for r in rows if r["row"] != "llama-bench --rpc") else 1


if __name__ == "__main__":
    sys.exit(main())
