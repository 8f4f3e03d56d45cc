"""The MoE expert cache's figures, read from a llama.cpp context.

The cache itself is engine code (patches/0002-moe-expert-cache.patch): a pool of expert slots,
on the GPU, shared by the MoE layers whose experts live in RAM; a decode step computes the routed
experts found in the pool there and only the others on the CPU. llama.cpp creates it with the
context when the environment asks (`LLAMA_MOE_CACHE_SLOTS=N`, `LLAMA_MOE_CACHE_DEVICE=cpu` for a
pool in RAM, `LLAMA_MOE_CACHE_SWAPS`, `LLAMA_MOE_CACHE_DECAY`), which leaves llama-cpp-python's
ctypes structs as they are. `environment` writes those variables; `read` asks the context for
its figures through the one C function the patch exports. An engine built without the patch
has no such function: `read` then says None, as for a context with no cache.

The runner gives a pool to the target context alone (`switched_on` around its creation, from
the plan's expert_cache_slots): drafter, embedding and vision contexts get none, so the
runner's environment never carries the slots variable itself (`without_switch`). With the
plan's expert_misses_on_gpu it also sets LLAMA_MOE_CACHE_MISSES=gpu there (patches/0003): the
GPU computes the misses from the experts where they lie in pinned RAM; the engine says in the
figures whether it did (`misses_on_gpu`), since it falls back to the CPU where it cannot.
LLAMA_MOE_CACHE_DEVICE=cpu, where the daemon's environment has it, passes through to the
runner: a pool in RAM, for tests on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

FIELDS = ("slots", "layers", "hits", "misses", "swaps", "steps", "pool_bytes", "misses_on_gpu")
SLOTS_VARIABLE = "LLAMA_MOE_CACHE_SLOTS"
MISSES_VARIABLE = "LLAMA_MOE_CACHE_MISSES"
SWAPS_VARIABLE = "LLAMA_MOE_CACHE_SWAPS"


@dataclass(frozen=True)
class ExpertCacheStats:
    slots: int  # experts the pool holds
    layers: int  # MoE layers that share it
    hits: int  # routed experts computed from the pool
    misses: int  # routed experts computed by the CPU
    swaps: int  # experts copied into the pool
    steps: int  # decode steps (ubatches of fewer than 32 tokens) seen
    pool_bytes: int
    misses_on_gpu: int  # 1: the GPU computed the misses from RAM in place (patches/0003)

    @property
    def hit_rate(self) -> float:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else 0.0


def environment(slots: int, device: str | None = None, swaps: int | None = None,
                decay: float | None = None, misses: str | None = None) -> dict[str, str]:
    """The variables that switch the cache on for contexts created after they are set."""
    if slots < 0:
        raise ValueError(f"expert cache slots must be 0 or more, not {slots}")
    env = {SLOTS_VARIABLE: str(slots)}
    if misses is not None:
        env[MISSES_VARIABLE] = misses
    if device is not None:
        env["LLAMA_MOE_CACHE_DEVICE"] = device
    if swaps is not None:
        env[SWAPS_VARIABLE] = str(swaps)
    if decay is not None:
        env["LLAMA_MOE_CACHE_DECAY"] = str(decay)
    return env


def without_switch(env: dict[str, str]) -> dict[str, str]:
    """`env` less the slots and misses variables: a process started with them would give
    every context it creates a pool of its own (the runner sets them around the target context
    only)."""
    return {k: v for k, v in env.items() if k not in (SLOTS_VARIABLE, MISSES_VARIABLE)}


@contextlib.contextmanager
def switched_on(slots: int, misses_on_gpu: bool = False, swaps: int = 0) -> Iterator[None]:
    """While it lasts, a context created gets a pool of `slots` experts (0: none, whatever
    the environment said), its misses computed by the GPU with `misses_on_gpu`, taking in at
    most `swaps` experts a step (0: the engine's default, or the environment's); the
    environment is as it was afterwards."""
    if slots < 0:
        raise ValueError(f"expert cache slots must be 0 or more, not {slots}")
    wanted = {SLOTS_VARIABLE: str(slots) if slots else None,
              MISSES_VARIABLE: "gpu" if slots and misses_on_gpu else None}
    if slots and swaps > 0:
        wanted[SWAPS_VARIABLE] = str(swaps)
    before = {name: os.environ.get(name) for name in wanted}
    _set(wanted)
    try:
        yield
    finally:
        _set(before)


def _set(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@functools.cache  # read after every answer: look the symbol up once
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
    if fn(ctx, out, len(FIELDS)) < len(FIELDS):  # 0: no cache (every engine has 0003's figure)
        return None
    return ExpertCacheStats(*out)
