"""The GPU suite's matrix: the shapes, the emulated card budgets and how to narrow them."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the MoE and hybrid shapes the planner serves with the expert cache, and one dense shape
SHAPES = ("qwen3-30b-a3b", "qwen35-35b-a3b", "qwen3-next-80b-a3b", "gpt-oss-20b", "llama-8b")
BUDGETS_GIB = (6, 12, 24)
ROUTING = {"qwen3-next-80b-a3b": "zipf:0.4"}  # as the benchmarks route them; others zipf:0.3


def selected(variable: str, default: tuple) -> tuple:
    value = os.environ.get(variable, "")
    return tuple(type(default[0])(v) for v in value.split(",") if v) or default


def gpu_engine() -> str:
    """Why the GPU suite cannot run here, or "" when it can."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return "no NVIDIA GPU"
    except Exception as e:  # no driver, no library
        return f"no NVIDIA GPU ({type(e).__name__})"
    try:
        import llama_cpp

        if not llama_cpp.llama_supports_gpu_offload():
            return "the engine is a CPU build"
        if not hasattr(llama_cpp.llama_cpp._lib, "llama_moe_cache_set_params"):  # the last patch
            return "the engine lacks the project's patches (tests/gpu/device_engine.sh)"
    except Exception as e:
        return f"no engine ({type(e).__name__}: {e})"
    return ""
