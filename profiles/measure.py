"""`localllm tune --measure`: load a plan for real, time prefill and decode, read VRAM from NVML,
and turn the error of the speed model into a calibration for this card.

Calibration is per card name, in `<config dir>/profiles/calibration.toml`: a factor on the card's
decode bandwidth efficiency (GPU) and on the host's bandwidth (CPU blocks), applied whenever the
card is resolved. The factor goes to the side that took most of the predicted time.
"""

from __future__ import annotations

import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import tomli_w

from localllm.errors import UserError
from localllm.modelstore.shape import ModelShape

from .card import Card
from .plan import Plan
from .saved import profiles_dir
from .speed import TOKEN_SECONDS


@dataclass(frozen=True)
class Measurement:
    prefill_tps: float
    decode_tps: float
    vram_bytes: int  # this process's GPU memory after the run (NVML), 0 without a GPU
    prompt_tokens: int
    decoded_tokens: int


def calibration_file() -> Path:
    return profiles_dir() / "calibration.toml"


def load_calibration(path: Path | None = None) -> dict:
    path = path or calibration_file()
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, dict)}


def calibrated(card: Card, path: Path | None = None) -> Card:
    """The card with the factors `--measure` stored for it and the host's measured disk rate
    (none: unchanged)."""
    from .calibrate import HOST_KEY, with_measured_disk

    doc = load_calibration(path)
    card = with_measured_disk(card, doc.get(HOST_KEY, {}))
    factors = doc.get(card.name, {})
    try:
        gpu = float(factors.get("gpu_bandwidth_factor", 1.0))
        host = float(factors.get("host_bandwidth_factor", 1.0))
    except (TypeError, ValueError):
        return card
    from .calibrate import with_measured_bandwidth

    card = with_measured_bandwidth(card, factors)  # from --calibrate, when it ran
    if not (0.01 <= gpu <= 100 and 0.01 <= host <= 100):
        return card
    return replace(card, decode_efficiency=card.decode_efficiency * gpu,
                   host_bandwidth_gbs=card.host_bandwidth_gbs * host)


def update_calibration(card_name: str, gpu_seconds: float, cpu_seconds: float,
                       measured_decode_tps: float, path: Path | None = None) -> dict:
    """Blame the prediction's error on the side (GPU or host) that took most of its time."""
    path = path or calibration_file()
    doc = load_calibration(path)
    entry = dict(doc.get(card_name, {}))
    measured = 1.0 / measured_decode_tps - TOKEN_SECONDS
    if cpu_seconds >= gpu_seconds and cpu_seconds > 0:
        rest = measured - gpu_seconds
        if rest > 0:
            key = "host_bandwidth_factor"
            entry[key] = float(entry.get(key, 1.0)) * cpu_seconds / rest
    elif gpu_seconds > 0:
        rest = measured - cpu_seconds
        if rest > 0:
            key = "gpu_bandwidth_factor"
            entry[key] = float(entry.get(key, 1.0)) * gpu_seconds / rest
    entry["measured_decode_tps"] = round(measured_decode_tps, 2)
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc[card_name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(doc))
    return entry


def process_vram_bytes() -> int:
    """GPU memory this process holds, summed over GPUs (NVML), 0 without NVML or a GPU."""
    import os
    import warnings

    try:
        with warnings.catch_warnings():  # pynvml warns that it is deprecated, on every import
            warnings.simplefilter("ignore")
            import pynvml
        pynvml.nvmlInit()
    except Exception:  # no driver, no GPU
        return 0
    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    total += int(proc.usedGpuMemory)
        return total
    except Exception:
        return 0
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


# The benchmark runs in a child that imports llama_cpp before anything that imports numpy: with
# a CUDA build, numpy loaded first makes the model load segfault (seen on an H200).
_CHILD = r"""
import llama_cpp
import json, sys
from localllm.profiles.measure import run_benchmark
from localllm.profiles.plan import Plan
req = json.loads(sys.stdin.read())
m = run_benchmark(req["path"], Plan.from_dict(req["plan"]), None, req["prompt"], req["tokens"])
print(json.dumps(m.__dict__))
"""


def measure_in_child(model_path: str, plan: Plan, prompt_tokens: int = 128,
                     decode_tokens: int = 32, timeout: float = 600) -> Measurement:
    import json
    import subprocess
    import sys

    request = json.dumps({"path": model_path, "plan": plan.to_dict(), "prompt": prompt_tokens,
                          "tokens": decode_tokens})
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=request, text=True,
                          capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        raise UserError(f"the benchmark load failed (exit {proc.returncode}): {last}")
    return Measurement(**json.loads(proc.stdout.strip().splitlines()[-1]))


def run_benchmark(model_path: str, plan: Plan, shape: ModelShape | None, prompt_tokens: int = 128,
                  decode_tokens: int = 32) -> Measurement:
    """Load with the plan, prefill a prompt, decode greedily; time both."""
    import llama_cpp

    from localllm.llama.params import GGML_TYPES
    from localllm.llama.overrides import tensor_overrides_applied

    prompt_tokens = max(8, min(prompt_tokens, plan.n_ctx - decode_tokens - 8))
    kwargs = dict(model_path=model_path, n_gpu_layers=plan.n_gpu_layers, n_ctx=plan.n_ctx,
                  n_batch=plan.n_batch, n_ubatch=plan.n_ubatch, n_threads=plan.n_threads,
                  n_threads_batch=plan.n_threads_batch, flash_attn=plan.flash_attn,
                  swa_full=plan.swa_full, type_k=GGML_TYPES[plan.type_k],
                  type_v=GGML_TYPES[plan.type_v], use_mmap=plan.use_mmap, verbose=False)
    if plan.tensor_split:
        kwargs["tensor_split"] = list(plan.tensor_split)
    with tensor_overrides_applied(plan.tensor_overrides):
        llm = llama_cpp.Llama(**kwargs)
    try:
        vocab = llm.n_vocab()
        # Ordinary token ids past the specials: any text-like sequence times the same.
        tokens = [(7 + 31 * i) % max(1, vocab - 300) + 259 for i in range(prompt_tokens)]
        start = time.perf_counter()
        llm.eval(tokens)
        prefill_s = time.perf_counter() - start
        # The evaluated prompt is reused as a prefix, so the first token comes from logits
        # already computed: time from it, over the tokens that each took a forward pass.
        n = 0
        first = time.perf_counter()
        for _ in llm.generate(tokens, temp=0.0):
            if n == 0:
                first = time.perf_counter()
            n += 1
            if n > decode_tokens:
                break
        decode_s = time.perf_counter() - first
        n -= 1
        vram = process_vram_bytes()
    finally:
        llm.close()
    return Measurement(prefill_tps=prompt_tokens / prefill_s, decode_tps=n / decode_s,
                       vram_bytes=vram, prompt_tokens=prompt_tokens, decoded_tokens=n)
