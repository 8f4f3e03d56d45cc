"""The dry run itself: llama.cpp's compute buffers for a plan, allocating nothing (an op of the
engine's child program, engine/runner/tuner_ops.py; profiles/dryrun.py asks it and caches
the answer).

Model params `no_alloc=True` with `load_mode=LLAMA_LOAD_MODE_NONE` read only metadata; creating
the context then logs `<device> compute buffer size = N MiB` for every device (and the KV and
recurrent sizes in total). Both are built by engine/params.py, as the runner builds them.
"""

from __future__ import annotations

import ctypes
import re

import llama_cpp
from localllm.planner.plan import Plan
from localllm.engine.probes import Buffers

from .params import context_params, model_params

MIB = 1 << 20
_BUFFER = re.compile(r"(\S+) compute buffer size =\s*([\d.]+) MiB")
_KV = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB")
_RS = re.compile(r"llama_memory_recurrent: size =\s*([\d.]+) MiB")


def parse_log(text: str) -> Buffers:
    """Compute buffers per device ("CUDA_Host" counts as the CPU's) and KV/state totals."""
    compute: dict[str, int] = {}
    for device, mib in _BUFFER.findall(text):
        device = "CPU" if device in ("CUDA_Host", "CPU") else device
        compute[device] = compute.get(device, 0) + int(float(mib) * MIB)
    return Buffers(compute, kv_bytes=int(sum(float(x) for x in _KV.findall(text)) * MIB),
                   state_bytes=int(sum(float(x) for x in _RS.findall(text)) * MIB))


_lines: list[str] = []


@llama_cpp.llama_log_callback
def _capture(level, text, _user_data):
    _lines.append(text.decode(errors="replace"))


def run(model_path: str, plan: Plan) -> Buffers:
    """The dry run in this process. llama.cpp keeps calling the log callback after we return,
    so it lives at module level (a callback freed under it crashes the process)."""
    from llama_cpp._logger import llama_log_callback as binding_logger

    _lines.clear()
    lines = _lines
    llama_cpp.llama_log_set(_capture, ctypes.c_void_p())
    try:
        llama_cpp.llama_backend_init()
        mparams, keep_alive = model_params(plan, metadata_only=True)
        model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
        del keep_alive
        if not model:
            raise RuntimeError("dry-run load failed: " + "".join(lines)[-400:])
        ctx = llama_cpp.llama_init_from_model(model, context_params(plan))
        if not ctx:
            raise RuntimeError("dry-run context failed: " + "".join(lines)[-400:])
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        return parse_log("".join(lines))
    finally:  # llama.cpp's log goes back where the binding sends it
        llama_cpp.llama_log_set(binding_logger, ctypes.c_void_p())
