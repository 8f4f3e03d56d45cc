#!/usr/bin/env python3
"""Benchmark the tuner on a real GPU against llama.cpp's own fitting, at emulated budgets.

One command runs issue 13's matrix (about 8 minutes of GPU time):

    source .device-carry/on-device.sh
    python3 -m scripts.bench.bench_tuner --out $OUT

- dense-27b (66 blocks, Q4_0) at a 12 GiB budget, 32K and 128K context; the 70B-class model
  (80 blocks, Q4_0, 37 GiB) at 24 GiB, 8K and 32K;
- ours: `tune_checked` for this GPU's card profile cut to the budget (compute buffers checked
  by dry-run loads), under the default quality policy (balanced) and, where it plans otherwise,
  quality = speed; one slot (fit runs -np 1); loaded in a child the way the runner loads;
- fit: `llama-server --fit on --fit-target (free - budget) -fa on -np 1`, f16 KV and q8_0 KV;
- decode after a short prompt and, for the 12 GiB rows, after filling half the context: the
  filled context is a sequence state of zeros restored into the cache (scripts/bench/kv_fill.py), so
  no 64K-token prompt is processed (decode reads the same bytes whatever they hold);
- VRAM: NVML's peak device memory used during each run, minus what was used before.

Prints a markdown table and writes it to OUT/bench.md (rows also to OUT/bench.jsonl as they
come). `--tiny` runs the same code on toy models on a CPU (a smoke test of the script).
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

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20




from scripts.bench import kv_fill  # noqa: E402
from scripts import synth_gguf  # noqa: E402

from localllm.modelstore.shape import read_shape  # noqa: E402
from localllm.planner.card import load_card  # noqa: E402
from localllm.profiles.choose import tune_checked  # noqa: E402
from localllm.engine.hardware import host_card, probe_card  # noqa: E402
from localllm.planner.search import NoPlanFits, Request  # noqa: E402

# (shape, budget GiB, context, measure after filling half the context too)
MATRIX = (("dense-27b", 12, 32768, True), ("dense-27b", 12, 131072, True),
          ("70b", 24, 8192, False), ("70b", 24, 32768, False))
TINY_MATRIX = (("llama-8b", 0.9, 1024, True), ("llama-8b", 0.9, 2048, False))
POLICIES = ("balanced", "speed")
FIT_KV = ("f16", "q8_0")


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
import ctypes, json, sys, time
import llama_cpp.llama_cpp as ll
from localllm.engine.params import GGML_TYPES
from localllm.engine.overrides import tensor_overrides_applied
from localllm.planner.plan import Plan
req = json.loads(sys.stdin.read())
plan = Plan.from_dict(req["plan"])
kwargs = dict(model_path=req["path"], n_gpu_layers=plan.n_gpu_layers, n_ctx=plan.n_ctx,
              n_batch=plan.n_batch, n_ubatch=plan.n_ubatch, n_threads=plan.n_threads,
              n_threads_batch=plan.n_threads_batch, flash_attn=plan.flash_attn,
              swa_full=plan.swa_full, type_k=GGML_TYPES[plan.type_k],
              type_v=GGML_TYPES[plan.type_v], use_mmap=plan.use_mmap, verbose=False)
with tensor_overrides_applied(plan.tensor_overrides):
    llm = llama_cpp.Llama(**kwargs)
ctx = llm._ctx.ctx
mem = ll.llama_get_memory(ctx)
n_vocab = llm.n_vocab()

def decode(n):
    tok = (ll.llama_token * 1)(n_vocab // 2)
    times = []
    for _ in range(n + 1):
        t0 = time.perf_counter()
        if ll.llama_decode(ctx, ll.llama_batch_get_one(tok, 1)) != 0:
            raise RuntimeError("llama_decode failed")
        logits = ll.llama_get_logits_ith(ctx, -1)
        tok[0] = max(range(0, n_vocab, max(1, n_vocab // 64)), key=lambda i: logits[i])
        times.append(time.perf_counter() - t0)
    return n / sum(times[1:])  # the first step warms up

out = {}
prompt = [(7 + 31 * i) % (n_vocab // 2) + n_vocab // 4 for i in range(64)]
ll.llama_memory_clear(mem, True)
t0 = time.perf_counter()
llm.eval(prompt)
out["prefill_tps"] = len(prompt) / (time.perf_counter() - t0)
out["decode_tps"] = decode(req["tokens"])
if req.get("fill"):
    ll.llama_memory_clear(mem, True)
    cap = req["fill_tokens"] + 8
    toks = (ll.llama_token * cap)()
    n_out = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    size = ll.llama_state_seq_load_file(ctx, req["fill"].encode(), 0, toks, cap,
                                        ctypes.byref(n_out))
    restored = ll.llama_memory_seq_pos_max(mem, 0) + 1
    out["fill_seconds"] = round(time.perf_counter() - t0, 1)
    if size == 0 or restored != req["fill_tokens"]:
        out["depth_error"] = f"state restore failed ({restored} cells)"
    else:
        out["depth"] = restored
        out["decode_at_depth_tps"] = decode(req["tokens"])
print(json.dumps(out))
"""


def run_ours(path: Path, plan, tokens: int, fill: Path | None, fill_tokens: int,
             timeout: float) -> dict:
    # Without mmap, llama.cpp reads the weights into buffers of its own: a sparse file's holes
    # become real memory (mapped, they could all alias one zero page and read from cache).
    request = json.dumps({"path": str(path), "plan": replace(plan, use_mmap=False).to_dict(),
                          "tokens": tokens, "fill": str(fill) if fill else None,
                          "fill_tokens": fill_tokens})
    with MemorySampler() as mem:
        proc = subprocess.run([sys.executable, "-c", CHILD], input=request, text=True,
                              capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        print(proc.stdout[-2000:], proc.stderr[-3000:], file=sys.stderr)
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        return {"error": f"exit {proc.returncode} {last}", "vram": mem.delta}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["vram"] = mem.delta
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, route: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def run_fit(path: Path, ctx: int, budget_mib: int, threads: int, tokens: int, kv: str,
            fill: Path | None, fill_tokens: list[int], timeout: float, log: Path) -> dict:
    """llama-server with llama.cpp's own fitting for the same budget and context."""
    sampler = MemorySampler()
    target = sampler.free() // MIB - budget_mib
    port = _free_port()
    cmd = ["llama-server", "-m", str(path), "-c", str(ctx), "--fit", "on", "--fit-target",
           str(target), "-t", str(threads), "-np", "1", "-fa", "on", "-ctk", kv, "-ctv", kv,
           "--port", str(port), "--host", "127.0.0.1", "--load-mode", "none"]
    if fill:
        cmd += ["--slot-save-path", str(fill.parent)]
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
            short = _post(port, "/completion", {
                "prompt": "The quick brown fox jumps over the lazy dog. " * 6,
                "n_predict": tokens, "ignore_eos": True, "temperature": 0,
                "cache_prompt": False}, timeout)["timings"]
            out = {"decode_tps": short["predicted_per_second"],
                   "prefill_tps": short["prompt_per_second"]}
            if fill:
                try:
                    _post(port, "/slots/0?action=restore", {"filename": fill.name}, timeout)
                    deep = _post(port, "/completion", {
                        "prompt": fill_tokens + fill_tokens[:4], "n_predict": tokens,
                        "ignore_eos": True, "temperature": 0, "cache_prompt": True}, timeout)
                    timings = deep["timings"]
                    out["depth"] = len(fill_tokens) + timings.get("prompt_n", 0)
                    if timings.get("prompt_n", 0) > 64:  # the restored prefix was not reused
                        out["depth_error"] = f"prompt re-processed ({timings['prompt_n']})"
                    out["decode_at_depth_tps"] = timings["predicted_per_second"]
                except OSError as e:
                    out["depth_error"] = f"restore: {e}"
            out["vram"] = mem.delta
            return out
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
    p.add_argument("--tokens", type=int, default=12, help="tokens decoded per measurement")
    p.add_argument("--type", default="Q4_0")
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--deadline", type=float, default=540, help="seconds; later runs skipped")
    p.add_argument("--no-fit", action="store_true", help="skip llama-server")
    p.add_argument("--margin", type=int, default=128, metavar="MiB",
                   help="VRAM the tuner leaves free inside the budget (the config's default is "
                   "512; llama-server's fit is given none: its target is free - budget)")
    p.add_argument("--tiny", action="store_true",
                   help="toy models and budgets: check the script on a CPU")
    args = p.parse_args(argv)
    if args.tiny:
        args.margin = 0
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("XDG_CACHE_HOME", str(Path(args.models) / "cache"))
    os.environ.setdefault("XDG_CONFIG_HOME", str(Path(args.models) / "config"))
    rows: list[dict] = []
    with open(out / "bench.jsonl", "a") as jsonl:
        run_all(args, start, out, jsonl, rows)
    table = markdown(rows)
    (out / "bench.md").write_text(table + "\n")
    print(table)
    return 0


def model_file(args, name: str) -> Path:
    config = synth_gguf.tiny(synth_gguf.SHAPES[name]) if args.tiny else synth_gguf.SHAPES[name]
    path = Path(args.models) / f"{config.name}-{args.type.lower()}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        synth_gguf.write_gguf(path, config, args.type, "random" if args.tiny else "sparse")
    return path


def our_plans(shape, card, ctx: int, margin: int) -> list[tuple[str, object]]:
    """The plans of each quality policy, without repeats."""
    plans, seen = [], set()
    for policy in POLICIES:
        request = Request(n_ctx=ctx, margin_bytes=margin * MIB, quality=policy, num_parallel=1)
        plan = tune_checked(shape, card, request, measure=True)
        if plan.load_key() not in seen:
            seen.add(plan.load_key())
            plans.append((policy, plan))
    return plans


def run_all(args, start: float, out: Path, jsonl, rows: list) -> None:
    fills = Path(args.models) / "fills"
    fills.mkdir(parents=True, exist_ok=True)
    for name, budget, ctx, deep in (TINY_MATRIX if args.tiny else MATRIX):
        path = model_file(args, name)
        shape = read_shape(path)
        card = gpu_card(budget)
        threads = card.cores
        half = ctx // 2 if deep and kv_fill.fillable(shape) else 0
        where = {"shape": name, "budget_gib": budget, "ctx": ctx}

        try:
            plans = our_plans(shape, card, ctx, args.margin)
        except NoPlanFits as e:
            plans = []
            print(f"{name} {budget} GiB {ctx}: no plan: {e}", flush=True)
        for policy, plan in plans:
            t0 = time.monotonic()
            if time.monotonic() - start > args.deadline:
                print(f"deadline: skipping ours {name} {ctx} {policy}", flush=True)
                continue
            fill, tokens = fill_for(fills, path, shape, half, plan.type_k, plan.type_v)
            result = run_ours(path, plan, args.tokens, fill, len(tokens), timeout=300)
            record(rows, jsonl, t0, {**where, "who": f"ours ({policy})", "plan": describe(plan),
                                     "pred_vram": plan.vram_bytes(),
                                     "pred": dict(plan.predicted_decode_by_depth), **result})
        if args.no_fit:
            continue
        for kv in FIT_KV:
            t0 = time.monotonic()
            if time.monotonic() - start > args.deadline:
                print(f"deadline: skipping fit {name} {ctx} {kv}", flush=True)
                continue
            fill, tokens = fill_for(fills, path, shape, half, kv, kv)
            result = run_fit(path, ctx, int(budget * 1024), threads, args.tokens, kv, fill,
                             tokens, timeout=300, log=out / f"fit-{name}-{ctx}-{kv}.log")
            record(rows, jsonl, t0, {**where, "who": f"fit, {kv} KV",
                                     "plan": "llama-server --fit", **result})


def fill_for(directory: Path, path: Path, shape, cells: int, type_k: str,
             type_v: str) -> tuple[Path | None, list[int]]:
    """A state file of `cells` filled cells for this model and KV type (None for no fill)."""
    if not cells:
        return None, []
    file = directory / f"{path.stem}-{cells}-{type_k}-{type_v}.bin"
    token = min(kv_fill.FILL_TOKEN, shape.n_vocab - 1)
    return file, kv_fill.write_fill(file, shape, cells, type_k, type_v, token)


def record(rows: list, jsonl, t0: float, row: dict) -> None:
    row["seconds"] = round(time.monotonic() - t0, 1)
    rows.append(row)
    jsonl.write(json.dumps(row) + "\n")
    jsonl.flush()
    print(format_row(row), flush=True)


def describe(plan) -> str:
    ffn = [o for o in plan.tensor_overrides if "ffn_(up|gate|down)" in o.pattern]
    text = f"ngl {plan.n_gpu_layers}, {plan.type_k} KV"
    if ffn:
        text += f", FFN of {ffn[0].pattern.count('|') - 1} blocks in RAM"
    if any("output" in o.pattern or "token_embd" in o.pattern for o in plan.tensor_overrides):
        text += ", lm-head in RAM"
    return text


def _mib(n) -> str:
    return f"{n / MIB:.0f}" if isinstance(n, (int, float)) else "-"


def _tps(d: dict, key: str) -> str:
    if key in d:
        return f"{d[key]:.2f}"
    return f"error: {d.get('error', d.get('depth_error', '-'))[:50]}" if d.get("error") or \
        (key == "decode_at_depth_tps" and d.get("depth_error")) else "-"


def format_row(row: dict) -> str:
    return (f"{row['shape']:10} {row['budget_gib']:>5g} GiB {row['ctx']:>6} {row['who']:16} "
            f"{row.get('plan', '-'):40} VRAM {_mib(row.get('vram'))} MiB (pred "
            f"{_mib(row.get('pred_vram'))}) | decode short {_tps(row, 'decode_tps')} | at "
            f"{row.get('depth', '-')} {_tps(row, 'decode_at_depth_tps')} | {row['seconds']} s")


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | budget | ctx | who | plan | VRAM peak (pred) MiB | decode, short prompt "
             "(pred) | decode at half fill (pred) | vs fit f16 (short / half) "
             "| vs fit q8_0 (short / half) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        pred = r.get("pred") or {}
        fits = {x["who"]: x for x in rows if x["shape"] == r["shape"] and x["ctx"] == r["ctx"]
                and x["who"].startswith("fit")}

        def ratio(other: dict | None, r: dict = r) -> str:
            if not other or not r["who"].startswith("ours"):
                return "-"
            parts = []
            for key in ("decode_tps", "decode_at_depth_tps"):
                a, b = r.get(key), other.get(key)
                parts.append(f"{a / b:.2f}x" if a and b else "-")
            return " / ".join(parts)

        half = r["ctx"] // 2
        pred_short = f" ({pred[0]:.1f})" if 0 in pred else ""
        pred_half = f" ({pred[half]:.1f})" if half in pred else ""
        lines.append(
            f"| {r['shape']} | {r['budget_gib']:g} GiB | {r['ctx']} | {r['who']} | "
            f"{r.get('plan', '-')} | {_mib(r.get('vram'))} ({_mib(r.get('pred_vram'))}) | "
            f"{_tps(r, 'decode_tps')}{pred_short} | {_tps(r, 'decode_at_depth_tps')}{pred_half} | "
            f"{ratio(fits.get('fit, f16 KV'))} | {ratio(fits.get('fit, q8_0 KV'))} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
