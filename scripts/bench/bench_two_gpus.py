#!/usr/bin/env python3
"""Two GPUs: a 70B-class model split by the tuner across two local cards, and across one local
card plus a `localllm worker` on the other, each against llama.cpp's own way.

    source .device-carry/on-device.sh
    python3 -m scripts.bench.bench_two_gpus --out $OUT            # nvidia-h200-x2, under 9 minutes
    python3 -m scripts.bench.bench_two_gpus --tiny --out /tmp/b2  # the same code on a CPU, a toy

The model is scripts/synth_gguf.py's `70b` (Q4_0, random weights, 37 GiB). Each card is
limited to --budgets GiB (default 24 and 12): the daemon by vram_margin_mib = free - budget +
margin (the margin is per GPU, so each card gets the budget), llama-server by `--fit on
--fit-target (free - budget)` for each device. Systems, each in turn with the model loaded
fresh, at each budget:
  ours-2     the daemon, both cards (its plan: tensor_split by layer, KV per card)
  fit-2      llama-server --fit on over both cards, q8_0 KV (f16 with --fit-kv f16)
  ours-1     the daemon with gpus = 0: one card plus RAM
then at the first budget, over RPC (the local process sees GPU 0 only, the worker GPU 1):
  ours-rpc   the daemon with rpc_workers = the worker (`localllm worker --device cuda0`)
  llama-rpc  llama-server --rpc with the daemon's split (-ts worker,local -ngl 999) and KV type
For each: decode of --tokens after a short prompt, then a --prompt-tokens prompt (prompt tok/s
from the time to the first token) and decode after it; the plan (from /api/ps: devices,
layers and sizes); the peak NVML memory of each card above its baseline, beside the budget.
Rows go to $OUT/two_gpus.jsonl as they are made and the table to $OUT/two_gpus.md. Systems that
would start past --deadline seconds are skipped (recorded as such).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402, F401  (a CUDA build must load before numpy)

from scripts import synth_gguf  # noqa: E402
from scripts.bench.bench_rpc import gpu_count, start_worker  # noqa: E402
from scripts.bench.bench_session import calibrate, text_of  # noqa: E402
from scripts.bench.bench_systems import Fit, Ours, wait_healthy  # noqa: E402
from scripts.bench.bench_tuner import MemorySampler  # noqa: E402

MIB = 1 << 20


class Daemon(Ours):
    """The daemon with extra settings (gpus, rpc_workers), and the environment it runs in."""

    def __init__(self, name: str, model: Path, ctx: int, margin_mib: int, tmp: Path,
                 env_extra: dict[str, str]):
        from tests.daemon_process import isolated_env, start_daemon

        from localllm.modelstore.store import ModelStore

        self.name = name
        env = isolated_env(tmp, LOCALLLM_NUM_PARALLEL="1", LOCALLLM_CONTEXT_POLICY="fixed",
                           LOCALLLM_CONTEXT_LENGTH=str(ctx), LOCALLLM_WORKLOAD="chat",
                           LOCALLLM_VRAM_MARGIN_MIB=str(margin_mib), **env_extra)
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
        self.daemon = start_daemon(env)
        self.url = self.daemon.url
        self.ctx = ctx

    def plan(self) -> str:
        [m] = self.daemon.get("/api/ps")["models"] or [{}]
        devices = "; ".join(f"{d['device']} {d['layers']} layers {d['size'] // MIB} MiB"
                            for d in m.get("devices", ()) if d["layers"])
        return (f"{m.get('processor', '')}, {m.get('kv_type', '')} KV, gpu_layers "
                f"{m.get('gpu_layers')}: {devices}")

    def split(self) -> tuple[list[tuple[str, int]], str]:
        """The loaded plan's layers per device and its KV type."""
        [m] = self.daemon.get("/api/ps")["models"]
        return [(d["device"], d["layers"]) for d in m.get("devices", ())], m.get("kv_type", "")


class Server(Fit):
    """llama-server with the given arguments and environment, /completion timed."""

    def __init__(self, name: str, args: list[str], env: dict, log: Path, what: str):
        import socket

        self.name, self.what = name, what
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = ["llama-server", *args, "-np", "1", "-fa", "on", "--port", str(port),
               "--host", "127.0.0.1"]
        self.log = open(log, "w")  # noqa: SIM115 (closed in stop(), after the server)
        self.log.write(" ".join(cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        wait_healthy(self.proc, self.url, log, 400)

    def plan(self) -> str:
        return self.what


def measure(system, args, record) -> None:
    warm = system.generate("Hello there. " * 4, 4)  # loads the model (ours) and warms up
    record({"system": system.name, "plan": system.plan(), "warm_s": round(warm["ttft"], 1)})
    short = system.generate("The quick brown fox jumps over the lazy dog. " * 6, args.tokens)
    cpt: list[float] = []
    c = calibrate(system, cpt, args.ctx)
    long = system.generate(text_of(int(args.prompt_tokens * c), 2), args.tokens)
    record({"system": system.name, "decode_tps": round(short["decode_tps"], 2),
            "prompt_tokens": long["prompt_tokens"],
            "prompt_tps": round(long["prompt_tokens"] / max(1e-9, long["ttft"]), 1),
            "decode_after_prompt_tps": round(long["decode_tps"], 2)})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="24,12", help="GiB per card, comma-separated")
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--margin", type=int, default=128, metavar="MiB",
                   help="VRAM the tuner leaves free inside each card's budget")
    p.add_argument("--systems", default="ours-2,fit-2,ours-1")
    p.add_argument("--rpc", default="ours-rpc,llama-rpc", help="'' to skip the RPC rows")
    p.add_argument("--fit-kv", default="q8_0")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 16)
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--deadline", type=float, default=480, help="seconds; later systems skipped")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="a toy model on a CPU, small sizes")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    if args.tiny:
        args.ctx, args.tokens, args.prompt_tokens, args.budgets = 1024, 8, 200, "1"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = synth_gguf.tiny(synth_gguf.SHAPES["70b"]) if args.tiny else synth_gguf.SHAPES["70b"]
    model = synth_gguf.ensure_model(args.models, config)
    n_gpus = gpu_count()
    samplers = [MemorySampler(i) for i in range(max(1, min(n_gpus, 2)))]
    free_mib = [s.free() // MIB for s in samplers]
    have_server = shutil.which("llama-server") is not None
    rows: list[dict] = []
    jsonl = open(out / "two_gpus.jsonl", "a")  # noqa: SIM115

    def record(row: dict) -> None:
        row = {"t": round(time.monotonic() - t0), **row}
        rows.append(row)
        jsonl.write(json.dumps(row) + "\n")
        jsonl.flush()
        print(json.dumps(row), flush=True)

    record({"gpus": n_gpus, "free_mib": free_mib, "model": str(model),
            "model_gib": round(model.stat().st_size / (1 << 30), 1)})
    ours_rpc: dict = {}  # the daemon's RPC split and KV type, for llama-server's run

    def run(name: str, budget: float, start) -> None:
        if time.monotonic() - t0 > args.deadline:
            record({"system": name, "budget_gib": budget, "skipped": "deadline"})
            return
        with tempfile.TemporaryDirectory() as tmp:
            peaks = [MemorySampler(i) for i in range(len(samplers))]
            for s in peaks:
                s.__enter__()
            system = None
            try:
                system = start(Path(tmp))
                measure(system, args, lambda r: record({**r, "budget_gib": budget}))
                if name == "ours-rpc":
                    ours_rpc["split"], ours_rpc["kv"] = system.split()
            except Exception as e:  # one system failing must not lose the others' rows
                record({"system": name, "budget_gib": budget,
                        "error": f"{type(e).__name__}: {e}"})
            finally:
                if system is not None:
                    system.stop()
                for s in peaks:
                    s.__exit__()
            peak = [(s.peak - s.baseline) // MIB for s in peaks if s.handle]
            record({"system": name, "budget_gib": budget, "peak_mib_per_card": peak,
                    "over_budget": any(m > int(budget * 1024) for m in peak)})

    def margin_for(budget: float) -> int:
        # the largest free memory, so that no card's usable memory passes the budget
        return max(0, max(free_mib) - int(budget * 1024) + args.margin) if n_gpus else 0

    def fit_targets(budget: float, devices: list[int]) -> str:
        return ",".join(str(max(0, free_mib[i] - int(budget * 1024))) for i in devices)

    for budget in (float(b) for b in args.budgets.split(",") if b):
        for name in args.systems.split(","):
            if name == "ours-2":
                run(name, budget, lambda tmp, b=budget: Daemon(
                    "ours-2", model, args.ctx, margin_for(b), tmp, {}))
            elif name == "ours-1":
                run(name, budget, lambda tmp, b=budget: Daemon(
                    "ours-1", model, args.ctx, margin_for(b), tmp, {"LOCALLLM_GPUS": "0"}))
            elif name == "fit-2":
                if not have_server or n_gpus < 2:
                    record({"system": name, "skipped": "needs llama-server and two GPUs"})
                    continue
                run(name, budget, lambda tmp, b=budget: Server(
                    "fit-2", ["-m", str(model), "-c", str(args.ctx), "--fit", "on",
                              "--fit-target", fit_targets(b, [0, 1]), "-t", str(args.threads),
                              "-ctk", args.fit_kv, "-ctv", args.fit_kv],
                    dict(os.environ), out / f"fit-2-{b:g}.log",
                    f"llama-server --fit on, {args.fit_kv} KV, both cards"))
            else:
                raise SystemExit(f"unknown system {name!r}")

    rpc = [r for r in args.rpc.split(",") if r]
    if rpc:
        budget = float(args.budgets.split(",")[0])
        local_env = {"CUDA_VISIBLE_DEVICES": "0"} if n_gpus else {}
        worker, endpoint = start_worker(1, n_gpus >= 2, max(1, args.threads // 2))
        try:
            for name in rpc:
                if name == "ours-rpc":
                    run(name, budget, lambda tmp: Daemon(
                        "ours-rpc", model, args.ctx, margin_for(budget), tmp,
                        {"LOCALLLM_RPC_WORKERS": endpoint, **local_env}))
                elif name == "llama-rpc":
                    counts = [n for d, n in ours_rpc.get("split", ()) if d != "CPU"]
                    if not have_server or not counts:
                        record({"system": name, "skipped": "needs llama-server and the "
                                "ours-rpc split"})
                        continue
                    kv = ours_rpc.get("kv") or "f16"
                    k, v = kv.split("/") if "/" in kv else (kv, kv)  # q8_0/q4_0: K and V
                    split = ",".join(str(n) for n in counts)
                    run(name, budget, lambda tmp, split=split, kv=kv, k=k, v=v: Server(
                        "llama-rpc", ["-m", str(model), "-c", str(args.ctx), "--rpc", endpoint,
                                      "-ngl", "999", "-ts", split, "-t", str(args.threads),
                                      "-ctk", k, "-ctv", v],
                        {**os.environ, **local_env}, out / "llama-rpc.log",
                        f"llama-server --rpc, -ts {split}, {kv} KV"))
                else:
                    raise SystemExit(f"unknown RPC system {name!r}")
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    jsonl.close()
    (out / "two_gpus.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| budget/card | system | figures |", "| --- | --- | --- |"]
    for r in rows:
        figures = {k: v for k, v in r.items() if k not in ("system", "budget_gib", "t")}
        lines.append(f"| {r.get('budget_gib', '')} | {r.get('system', '')} | "
                     f"{json.dumps(figures)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
