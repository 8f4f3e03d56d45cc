"""Dry-run loads: llama.cpp's own compute buffer sizes for a plan, without allocating anything.

Model params `no_alloc=True` with `load_mode=LLAMA_LOAD_MODE_NONE` read only metadata; creating
a context then logs `<device> compute buffer size = N MiB` for every device (and the KV and
recurrent sizes in total). A dry run creates a CUDA context, so it runs in a child process
(`python -m localllm.profiles.dryrun`, plan as JSON on stdin, result as JSON on stdout): the
daemon never holds GPU memory of its own. Results are cached per model file and setting in
the cache dir, so a model is probed once per setting.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from localllm import paths

from .plan import Plan

MIB = 1 << 20
_BUFFER = re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")
_RS = re.compile(r"llama_memory_recurrent: size =\s*([\d.]+) MiB")
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
              "iq4_nl": 20, "bf16": 30}


def parse_log(text: str) -> dict:
    """Compute buffers per device ("CUDA_Host" counts as the CPU's) and KV/state totals."""
    compute: dict[str, int] = {}
    for device, mib in _BUFFER.findall(text):
        device = "CPU" if device in ("CUDA_Host", "CPU") else device
        compute[device] = compute.get(device, 0) + int(float(mib) * MIB)
    return {
        "compute": compute,
        "kv_bytes": int(sum(float(x) for x in _KV.findall(text)) * MIB),
        "state_bytes": int(sum(float(x) for x in _RS.findall(text)) * MIB),
    }


def _cache_file(model_path: str, plan: Plan) -> Path:
    st = os.stat(model_path)
    key = json.dumps([os.path.abspath(model_path), st.st_size, int(st.st_mtime),
                      plan.n_ctx, plan.n_gpu_layers, plan.n_ubatch, plan.flash_attn,
                      plan.type_k, plan.type_v, plan.swa_full, plan.n_parallel,
                      [(o.pattern, o.device) for o in plan.tensor_overrides],
                      list(plan.tensor_split), os.environ.get("LLAMA_CPP_LIB_PATH", "")])
    return paths.cache_dir() / "dryrun" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def dry_run(model_path: str, plan: Plan, timeout: float = 120.0) -> dict | None:
    """llama.cpp's buffers for this plan ({"compute": {device: bytes}, "kv_bytes", ...}), from
    the cache or a child process; None when the dry run failed (the formula stands in)."""
    cache = _cache_file(model_path, plan)
    if cache.is_file():
        try:
            return json.loads(cache.read_text())
        except (OSError, ValueError):
            pass
    request = json.dumps({"model_path": model_path, "plan": plan.to_dict()})
    try:
        proc = subprocess.run([sys.executable, "-m", "localllm.profiles.dryrun"], input=request,
                              capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None
    if not result.get("compute"):
        return None
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


def _run_in_child(model_path: str, plan: Plan) -> dict:
    import ctypes

    import llama_cpp.llama_cpp as llama

    from .llama_overrides import apply_tensor_overrides

    lines: list[str] = []

    @llama.llama_log_callback
    def capture(level, text, user_data):
        lines.append(text.decode(errors="replace"))

    llama.llama_log_set(capture, ctypes.c_void_p())
    llama.llama_backend_init()
    mp = llama.llama_model_default_params()
    mp.no_alloc = True
    mp.load_mode = llama.LLAMA_LOAD_MODE_NONE
    mp.n_gpu_layers = plan.n_gpu_layers
    keep = apply_tensor_overrides(mp, plan.tensor_overrides)
    split = None
    if plan.tensor_split:
        split = (ctypes.c_float * llama.llama_max_devices())(*plan.tensor_split)
        mp.tensor_split = split
    model = llama.llama_model_load_from_file(model_path.encode(), mp)
    if not model:
        raise RuntimeError("dry-run load failed: " + "".join(lines)[-400:])
    cp = llama.llama_context_default_params()
    # As the runner creates it: one stream of n_ctx cells per slot (not unified).
    cp.n_ctx = plan.n_ctx * plan.n_parallel
    cp.n_batch = plan.n_batch
    cp.n_ubatch = plan.n_ubatch
    cp.n_seq_max = plan.n_parallel
    cp.kv_unified = False
    cp.flash_attn_type = 1 if plan.flash_attn else 0
    cp.type_k = GGML_TYPES[plan.type_k]
    cp.type_v = GGML_TYPES[plan.type_v]
    cp.swa_full = plan.swa_full
    ctx = llama.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("dry-run context failed: " + "".join(lines)[-400:])
    del keep, split
    return parse_log("".join(lines))


def main() -> int:
    request = json.loads(sys.stdin.read())
    result = _run_in_child(request["model_path"], Plan.from_dict(request["plan"]))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
