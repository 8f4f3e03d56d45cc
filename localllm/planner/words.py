"""How the plan's reasons write figures (sizes in GiB, speeds in tok/s, times in seconds)
and placements (which blocks, and which of their weights, sit where)."""

from __future__ import annotations

from localllm.modelstore.shape import ModelShape

from .card import GIB
from .placements import head_in_ram, kind_of
from .search import Option


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def tps(x: float) -> str:
    if x < 1:  # plans that read from disk
        return f"{x:.2f} tok/s"
    return f"{x:.1f} tok/s" if x < 100 else f"{x:.0f} tok/s"


def seconds(t: float) -> str:
    return f"{t:.1f} s" if t < 100 else f"{t:.0f} s"


def describe_placement(option: Option, shape: ModelShape) -> str:
    p = option.placement
    n_blocks = shape.n_layer_main
    n_gpu_blocks = sum(1 for m in _gpu_block_indices(option, shape))
    if not option.vram_used and p.n_gpu_layers == 0:
        return f"all {n_blocks} blocks on the CPU"
    head = "the lm-head on the CPU" if head_in_ram(p) or p.n_gpu_layers == 0 else \
        "the lm-head on the GPU"
    return kind_of(p).describe(p, n_blocks, n_gpu_blocks, head)


def _gpu_block_indices(option: Option, shape: ModelShape):
    n_all = shape.n_layer + 1
    start = n_all - min(option.placement.n_gpu_layers, n_all)
    return [i for i in range(shape.n_layer_main) if i >= start]
