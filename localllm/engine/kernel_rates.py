"""ggml's own CPU kernels for experts, timed on this machine: the rate (GB/s of expert weights)
at which llama.cpp's threads multiply the experts a GPU plan keeps in RAM, by quantization type
and thread count. The runner's `kernel_rates` op (engine/runner/tuner_ops.py) runs it in a
process of its own; profiles/host_prices.py stores what it measures, and the speed model prices
the CPU's experts with it (planner/host_reads.py).

Why the kernels and not a read of RAM: on one H100 lease's host a numpy read of RAM priced the
CPU's experts 1.66x too fast (73.9 GB/s at 16 threads, where llama.cpp's expert matmuls went at
about 45), and the fresh plan's decode was predicted 46-48% over what it served; on another
host the same read priced them within 8%. Where the CPU, not RAM, sets the pace (older cores,
a K-quant's heavier unpacking) only the kernel itself says so.

The graph is a decode step's expert work, batch 1: per block, gate, up and down as
ggml_mul_mat_id over the experts a token is routed to (a typical expert: 2048 wide, 768 deep,
8 routed), enough blocks that their weights (BUFFER_BYTES) are well past any last-level
cache, computed by ggml_graph_compute with each thread count; the best of REPEATS passes. The
weights are zeros: the kernels' work does not depend on the values; zero scales keep denormals
out.
ggml is reached through ctypes (llama-cpp-python binds llama.h, not ggml.h), from the same
libraries the runner's llama.cpp loads.
"""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

BUFFER_BYTES = 512 << 20  # the experts of 20-40 blocks, past any last-level cache
REPEATS = 3
N_EMBD, N_FF, N_USED = 2048, 768, 8  # Qwen3-30B-A3B's experts; the rate moves little with them
# ggml_type values (ggml.h) of the types MoE GGUFs keep their experts in
TYPES = {"Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "MXFP4": 39}
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26
SLACK_BYTES = 32 << 20  # tensor headers and the graph (the work buffer is apart: _compute)

_vp = ctypes.c_void_p


class _InitParams(ctypes.Structure):  # struct ggml_init_params, passed by value
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", _vp), ("no_alloc", ctypes.c_bool)]


class _CPlan(ctypes.Structure):  # struct ggml_cplan (ggml-cpu.h), returned by value
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", _vp), ("n_threads", ctypes.c_int),
                ("threadpool", _vp), ("abort_callback", _vp), ("abort_callback_data", _vp),
                ("use_ref", ctypes.c_bool)]


def library_folder() -> Path:
    """Where the runner's llama.cpp loads ggml from: LLAMA_CPP_LIB_PATH (a CUDA build on a GPU
    machine) or llama-cpp-python's own lib folder."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def _bind(folder: Path):
    base = ctypes.CDLL(str(folder / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(folder / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    signatures = {
        (base, "ggml_init"): (_vp, [_InitParams]),
        (base, "ggml_free"): (None, [_vp]),
        (base, "ggml_new_tensor_2d"): (_vp, [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]),
        (base, "ggml_new_tensor_3d"): (_vp, [_vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_int64]),
        (base, "ggml_mul_mat_id"): (_vp, [_vp, _vp, _vp, _vp]),
        (base, "ggml_new_graph_custom"): (_vp, [_vp, ctypes.c_size_t, ctypes.c_bool]),
        (base, "ggml_build_forward_expand"): (None, [_vp, _vp]),
        (base, "ggml_get_data"): (_vp, [_vp]),
        (base, "ggml_nbytes"): (ctypes.c_size_t, [_vp]),
        (base, "ggml_row_size"): (ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]),
        (cpu, "ggml_cpu_init"): (None, []),
        (cpu, "ggml_graph_plan"): (_CPlan, [_vp, ctypes.c_int, _vp]),
        (cpu, "ggml_graph_compute"): (ctypes.c_int, [_vp, ctypes.POINTER(_CPlan)]),
    }
    for (lib, name), (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    cpu.ggml_cpu_init()
    return base, cpu


def _zeroed(base, tensor) -> int:
    n = base.ggml_nbytes(tensor)
    ctypes.memset(base.ggml_get_data(tensor), 0, n)
    return n


def _expert_step(base, type_id: int, buffer_bytes: int):
    """A context holding blocks of routed experts (`type_id`) and the graph of one decode
    step over them; (context, graph, weight bytes)."""
    per_block = N_USED * (2 * N_FF * base.ggml_row_size(type_id, N_EMBD)
                          + N_EMBD * base.ggml_row_size(type_id, N_FF))
    blocks = max(1, buffer_bytes // per_block)
    nodes = 4 * blocks + 8
    ctx = base.ggml_init(_InitParams(int(per_block * blocks * 1.01) + SLACK_BYTES, None, False))
    if not ctx:
        raise MemoryError(f"ggml could not allocate {per_block * blocks >> 20} MiB")
    graph = base.ggml_new_graph_custom(ctx, nodes, False)
    x = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, N_EMBD, 1, 1)  # the token, to every expert
    h = base.ggml_new_tensor_3d(ctx, GGML_TYPE_F32, N_FF, N_USED, 1)  # each expert's own input
    ids = base.ggml_new_tensor_2d(ctx, GGML_TYPE_I32, N_USED, 1)
    _zeroed(base, x), _zeroed(base, h)
    (ctypes.c_int32 * N_USED).from_address(base.ggml_get_data(ids))[:] = range(N_USED)
    weights = 0
    for _ in range(blocks):
        for cols, rows, inp in ((N_EMBD, N_FF, x), (N_EMBD, N_FF, x), (N_FF, N_EMBD, h)):
            experts = base.ggml_new_tensor_3d(ctx, type_id, cols, rows, N_USED)
            weights += _zeroed(base, experts)
            base.ggml_build_forward_expand(graph, base.ggml_mul_mat_id(ctx, experts, inp, ids))
    return ctx, graph, weights


def measure_kernel_gbs(types: list[str], threads: list[int], buffer_bytes: int = BUFFER_BYTES,
                       folder: Path | None = None) -> dict[str, dict[int, float]]:
    """GB/s of expert weights ggml's CPU kernels multiply at decode, per type and thread count.
    A type this ggml does not know is left out."""
    base, cpu = _bind(folder or library_folder())
    rates: dict[str, dict[int, float]] = {}
    for name in types:
        type_id = TYPES.get(name)
        if type_id is None:
            continue
        ctx, graph, weights = _expert_step(base, type_id, buffer_bytes)
        try:
            _compute(cpu, graph, max(threads))  # pages and threads warm
            rates[name] = {}
            for n in threads:
                best = min(_compute(cpu, graph, n) for _ in range(REPEATS))
                rates[name][n] = round(weights / best / 1e9, 2)
        finally:
            base.ggml_free(ctx)
    return rates


def _compute(cpu, graph, n_threads: int) -> float:
    """Seconds one pass of `graph` took on `n_threads` threads. The work buffer is this
    call's own, not the context's: ggml_graph_compute_with_ctx takes a new one from the
    context at every call, and an H100 host's 16 threads ran a 512 MiB context out of room."""
    plan = cpu.ggml_graph_plan(graph, n_threads, None)
    work = ctypes.create_string_buffer(max(1, plan.work_size))
    plan.work_data = ctypes.cast(work, _vp)
    plan.use_ref = False
    start = time.perf_counter()
    status = cpu.ggml_graph_compute(graph, ctypes.byref(plan))
    seconds = time.perf_counter() - start
    if status != 0:
        raise RuntimeError(f"ggml_graph_compute failed ({status})")
    return seconds
