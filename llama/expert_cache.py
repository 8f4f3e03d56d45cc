"""The MoE expert cache's figures, read from a llama.cpp context.

The cache itself is engine code (patches/0002-moe-expert-cache.patch): a pool of expert slots,
on the GPU, shared by the MoE layers whose experts live in RAM; a decode step computes the routed
experts found in the pool there and only the others on the CPU. llama.cpp creates it with the
context when the environment asks (`LLAMA_MOE_CACHE_SLOTS=N`, `LLAMA_MOE_CACHE_DEVICE=cpu` for a
pool in RAM, `LLAMA_MOE_CACHE_SWAPS`, `LLAMA_MOE_CACHE_DECAY`), which leaves llama-cpp-python's
ctypes structs as they are. `environment` writes those variables; `read` asks the context for
its figures through the one C function the patch exports. An engine built without the patch
has no such function: `read` then says None, as for a context with no cache.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

FIELDS = ("slots", "layers", "hits", "misses", "swaps", "steps", "pool_bytes")


@dataclass(frozen=True)
class ExpertCacheStats:
    slots: int  # experts the pool holds
    layers: int  # MoE layers that share it
    hits: int  # routed experts computed from the pool
    misses: int  # routed experts computed by the CPU
    swaps: int  # experts copied into the pool
    steps: int  # decode steps (ubatches of fewer than 32 tokens) seen
    pool_bytes: int

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


def environment(slots: int, device: str | None = None, swaps: int | None = None,
                decay: float | None = None) -> dict[str, str]:
    """The variables that switch the cache on for contexts created after they are set."""
    if slots < 0:
        raise ValueError(f"expert cache slots must be 0 or more, not {slots}")
    env = {"LLAMA_MOE_CACHE_SLOTS": str(slots)}
    if device is not None:
        env["LLAMA_MOE_CACHE_DEVICE"] = device
    if swaps is not None:
        env["LLAMA_MOE_CACHE_SWAPS"] = str(swaps)
    if decay is not None:
        env["LLAMA_MOE_CACHE_DECAY"] = str(decay)
    return env


def _stats_function():
    import llama_cpp.llama_cpp as llama_lib

    fn = getattr(llama_lib._lib, "llama_moe_cache_stats", None)
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int32]
        fn.restype = ctypes.c_int32
    return fn


def read(ctx) -> ExpertCacheStats | None:
    """The figures of a context (`llama_context_p`), or None when it has no cache."""
    fn = _stats_function()
    if fn is None:
        return None
    out = (ctypes.c_int64 * len(FIELDS))()
    if fn(ctx, out, len(FIELDS)) < len(FIELDS):
        return None
    return ExpertCacheStats(*out)
