#!/usr/bin/env python3
"""Benchmark the tuner on a real GPU against llama.cpp's own fitting, at emulated budgets.

For each synthetic shape, budget (GiB of a card emulated on this GPU) and context, it
  1. plans with `localllm.profiles` for the GPU's card profile cut to the budget (compute
     buffers checked by dry-run loads of llama.cpp),
  2. loads that plan for real in a child process (llama-cpp-python, the runner's load path),
     decodes a few dozen tokens after a short prompt, and samples the device's used memory with
     NVML the whole time,
  3. runs `llama-server --fit on --fit-target (free - budget)` at the same context and measures
     it the same way (its /completion timings, NVML),
and prints predicted vs measured VRAM and decode speed beside llama.cpp's.

    source .device-carry/on-device.sh
    python scripts/bench_tuner.py --out $OUT --budgets 12 24 --contexts 4096 32768 131072

Models are written as sparse synthetic GGUFs (no disk used, llama.cpp reads zeros; speed and
memory do not depend on weight values). Results go to OUT/bench.jsonl as they come, then a
markdown table to OUT/bench.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


import checkout_imports  # noqa: E402

checkout_imports.bootstrap()
sys.path.insert(0, str(ROOT / "scripts"))

import synth_gguf  # noqa: E402

from localllm.modelstore.shape import read_shape  # noqa: E402
from localllm.profiles.card import load_card  # noqa: E402
from localllm.profiles.choose import tune_checked  # noqa: E402
from localllm.profiles.hardware import host_card, probe_card  # noqa: E402
from localllm.profiles.tuner import NoPlanFits, Request  # noqa: E402


class MemorySampler:
    """Peak device memory used (NVML) above a baseline, sampled every 50 ms in a thread."""

    def __init__(self, device: int = 0):
        self.handle = None
        self.peak = 0
        self._stop = threading.Event()
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        except Exception:  # no GPU here: memory reads as 0 (a smoke run of the script)
            pass

    def used(self) -> int:
        if self.handle is None:
            return 0
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def free(self) -> int:
        if self.handle is None:
            return 0
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free)

    def __enter__(self):
        self.baseline = self.used()
        self.peak = self.baseline
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.05)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


# llama_cpp first: with the CUDA build, loading numpy (gguf, ModelShape) before libllama makes
# the model load segfault (seen on the H200 with the image's numpy).
CHILD = r"""
import llama_cpp
import faulthandler, json, sys
faulthandler.enable(open("/tmp/bench-child-fault.txt", "w"), all_threads=True)
from localllm.modelstore.shape import read_shape
from localllm.profiles.measure import run_benchmark
from localllm.profiles.plan import Plan
req = json.loads(sys.stdin.read())
m = run_benchmark(req["path"], Plan.from_dict(req["plan"]), read_shape(req["path"]),
                  prompt_tokens=req["prompt"], decode_tokens=req["tokens"])
print(json.dumps({"prefill_tps": m.prefill_tps, "decode_tps": m.decode_tps}))
"""


def run_ours(path: Path, plan, tokens: int, timeout: float) -> dict:
    # Without mmap, llama.cpp reads the weights into buffers of its own: a sparse file's holes
    # become real memory (mapped, they could all alias one zero page and read from cache).
    request = json.dumps({"path": str(path), "plan": replace(plan, use_mmap=False).to_dict(),
                          "prompt": 64, "tokens": tokens})
    with MemorySampler() as mem:
        proc = subprocess.run([sys.executable, "-c", CHILD], input=request, text=True,
                              capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        fault = Path("/tmp/bench-child-fault.txt")
        print(proc.stdout[-2000:], proc.stderr[-3000:], fault.read_text()[-3000:]
              if fault.exists() else "", file=sys.stderr)
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        return {"error": f"exit {proc.returncode} {last}", "vram": mem.delta}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["vram"] = mem.delta
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fit(path: Path, ctx: int, budget_mib: int, threads: int, tokens: int,
            timeout: float, log: Path) -> dict:
    """llama-server with llama.cpp's own fitting for the same budget and context."""
    sampler = MemorySampler()
    target = sampler.free() // MIB - budget_mib
    port = _free_port()
    cmd = ["llama-server", "-m", str(path), "-c", str(ctx), "--fit", "on", "--fit-target",
           str(target), "-t", str(threads), "-np", "1", "--port", str(port),
           "--host", "127.0.0.1", "--load-mode", "none"]
    with sampler as mem, open(log, "w") as logf:
        server = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    return {"error": f"llama-server exited {server.returncode}", "vram": mem.delta}
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            else:
                return {"error": "llama-server did not start in time", "vram": mem.delta}
            body = json.dumps({"prompt": "The quick brown fox jumps over the lazy dog. " * 6,
                               "n_predict": tokens, "ignore_eos": True, "temperature": 0,
                               "cache_prompt": False}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=timeout) as r:
                timings = json.loads(r.read())["timings"]
            return {"decode_tps": timings["predicted_per_second"],
                    "prefill_tps": timings["prompt_per_second"], "vram": mem.delta}
        finally:
            _stop(server)


def _stop(server: subprocess.Popen) -> None:
    if server.poll() is not None:
        return
    try:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    except ProcessLookupError:
        pass


def gpu_card(budget_gib: float):
    """This GPU's profile cut to the budget, with this machine's host."""
    probed = probe_card()
    base = load_card(probed.name) if probed.has_gpu else load_card("h200")
    host = host_card()
    return base.with_host(host.ram_bytes, host.cores, host.host_bandwidth_gbs).with_vram(
        budget_gib)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["dense-27b"], choices=list(synth_gguf.SHAPES))
    p.add_argument("--budgets", nargs="+", type=float, default=[12, 24])
    p.add_argument("--contexts", nargs="+", type=int, default=[4096, 32768, 131072])
    p.add_argument("--tokens", type=int, default=32, help="tokens decoded per measurement")
    p.add_argument("--type", default="Q4_0")
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--out", default=".")
    p.add_argument("--deadline", type=float, default=560, help="seconds; later runs skipped")
    p.add_argument("--no-fit", action="store_true", help="skip llama-server")
    p.add_argument("--margin", type=int, default=512, metavar="MiB",
                   help="VRAM the tuner leaves free inside the budget (the config's default is "
                   "512; llama-server's fit is given none: its target is free - budget)")
    args = p.parse_args(argv)
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_CACHE_HOME", str(Path(args.models) / "cache"))
    os.environ.setdefault("XDG_CONFIG_HOME", str(Path(args.models) / "config"))
    rows = []
    with open(out / "bench.jsonl", "a") as jsonl:
        run_all(args, start, out, jsonl, rows)
    table = markdown(rows)
    (out / "bench.md").write_text(table + "\n")
    print(table)
    return 0


def run_all(args, start: float, out: Path, jsonl, rows: list) -> None:
    for name in args.shapes:
        path = Path(args.models) / f"{name}-{args.type.lower()}.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            synth_gguf.write_gguf(path, synth_gguf.SHAPES[name], args.type, "sparse")
        shape = read_shape(path)
        for budget in args.budgets:
            card = gpu_card(budget)
            for ctx in args.contexts:
                if time.monotonic() - start > args.deadline:
                    print(f"deadline: skipping {name} {budget} GiB {ctx}", flush=True)
                    continue
                row = {"shape": name, "budget_gib": budget, "ctx": ctx, "margin_mib": args.margin}
                t0 = time.monotonic()
                try:
                    request = Request(n_ctx=ctx, margin_bytes=args.margin * MIB)
                    plan = tune_checked(shape, card, request, measure=True)
                except NoPlanFits as e:
                    row["error"] = str(e)
                    plan = None
                if plan is not None:
                    row.update(plan=dict(ngl=plan.n_gpu_layers, kv=plan.type_k,
                                         ub=plan.n_ubatch, overrides=len(plan.tensor_overrides)),
                               pred_vram=plan.vram_bytes(), pred_decode=plan.predicted_decode_tps)
                    row["ours"] = run_ours(path, plan, args.tokens, timeout=240)
                if not args.no_fit:
                    row["fit"] = run_fit(path, ctx, int(budget * 1024), card.cores, args.tokens,
                                         timeout=240, log=out / f"fit-{name}-{budget:g}-{ctx}.log")
                row["seconds"] = round(time.monotonic() - t0, 1)
                rows.append(row)
                jsonl.write(json.dumps(row) + "\n")
                jsonl.flush()
                print(format_row(row), flush=True)


def _mib(n) -> str:
    return f"{n / MIB:.0f}" if isinstance(n, (int, float)) else "-"


def _tps(d: dict | None) -> str:
    if not d or "decode_tps" not in d:
        return f"error: {d.get('error', '?')[:60]}" if d else "-"
    return f"{d['decode_tps']:.1f}"


def format_row(row: dict) -> str:
    ours, fit = row.get("ours") or {}, row.get("fit") or {}
    plan = row.get("plan") or {}
    return (f"{row['shape']:14} {row['budget_gib']:>4g} GiB {row['ctx']:>6}  "
            f"plan ngl={plan.get('ngl')} kv={plan.get('kv')} | "
            f"VRAM pred {_mib(row.get('pred_vram'))} meas "
            f"{_mib(ours.get('vram'))} MiB | decode pred {row.get('pred_decode', 0):.1f} meas "
            f"{_tps(ours)} | fit {_mib(fit.get('vram'))} MiB {_tps(fit)} tok/s "
            f"| {row['seconds']} s")


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | budget (margin MiB) | ctx | plan | VRAM predicted | VRAM measured "
             "| decode predicted | decode measured | llama.cpp fit VRAM | fit decode "
             "| ours / fit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ours, fit, plan = r.get("ours") or {}, r.get("fit") or {}, r.get("plan") or {}
        ratio = (f"{ours['decode_tps'] / fit['decode_tps']:.2f}x"
                 if "decode_tps" in ours and fit.get("decode_tps") else "-")
        desc = (f"ngl {plan['ngl']}, {plan['kv']} KV, ub {plan['ub']}"
                + (f", {plan['overrides']} override(s)" if plan.get("overrides") else "")
                if plan else r.get("error", "-")[:80])
        lines.append(
            f"| {r['shape']} | {r['budget_gib']:g} GiB ({r.get('margin_mib', 512)}) | {r['ctx']} "
            f"| {desc} | "
            f"{_mib(r.get('pred_vram'))} MiB | {_mib(ours.get('vram'))} MiB | "
            f"{r.get('pred_decode', 0):.1f} | {_tps(ours)} | {_mib(fit.get('vram'))} MiB | "
            f"{_tps(fit)} | {ratio} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
