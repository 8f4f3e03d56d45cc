"""The GPU suite: real daemons on a real NVIDIA GPU with the patched CUDA engine, on synthetic
models of the shapes the planner serves. Every test here is skipped where there is no GPU, so
the CPU suite (CI) collects it and moves on. On the GPU machine:

    source .device-carry/on-device.sh && eval "$(bash tests/gpu/device_engine.sh)"
    python3 -m pytest -c tests/gpu/pytest.ini tests/gpu -v

LOCALLLM_GPU_SHAPES and LOCALLLM_GPU_BUDGETS (comma lists) narrow the matrix so that one device
call stays under 10 minutes; models are written once into LOCALLLM_GPU_MODELS (/tmp/models).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from matrix import ROUTING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

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
        if not hasattr(llama_cpp.llama_cpp._lib, "llama_moe_cache_stats"):
            return "the engine lacks the project's patches (tests/gpu/device_engine.sh)"
    except Exception as e:
        return f"no engine ({type(e).__name__}: {e})"
    return ""


def pytest_collection_modifyitems(config, items):
    why = gpu_engine()
    for item in items:
        if "gpu" in item.keywords and why:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def bootstrapped():
    import checkout_imports

    checkout_imports.bootstrap()


@pytest.fixture(scope="session")
def synthetic(bootstrapped):
    """shape name -> its synthetic Q4_0 model (written on first use, kept for the session)."""
    import synth_gguf

    directory = Path(os.environ.get("LOCALLLM_GPU_MODELS", "/tmp/models"))

    def model(shape: str) -> Path:
        return synth_gguf.ensure_model(directory, synth_gguf.SHAPES[shape],
                                       routing=ROUTING.get(shape, "zipf:0.3")
                                       if synth_gguf.SHAPES[shape].n_expert else "uniform")

    return model
