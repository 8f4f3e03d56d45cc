"""The MoE expert cache's settings, given to llama.cpp, and its figures, read from a context.

The cache itself is engine code (patches/0002-moe-expert-cache.patch): a pool of expert slots,
on the GPU, shared by the MoE layers whose experts live in RAM; a decode step computes the routed
experts found in the pool there and only the others on the CPU. llama.cpp creates it with a
context, from the settings last given to `llama_moe_cache_set_params` (patches/0006), a C
function apart from llama_context_params so that llama-cpp-python's ctypes struct of those stays
as it is. `switched_on` gives them around one context's creation; `read` asks a context for its
figures. An engine built without the patches has neither function: no pool is made, and `read`
says None, as for a context with no cache.

The runner gives a pool to the target context alone (engine/model.py, from the plan through
engine/params.py): once the target context is made, the settings say "no pool" for the rest of
the process, so drafter and embedding contexts get none. llama.cpp reads its LLAMA_MOE_CACHE_*
environment variables only while no settings were ever given (its own tools); the project never
sets them.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

log = logging.getLogger("localllm.runner.expert_cache")
FIELDS = ("slots", "layers", "hits", "misses", "swaps", "steps", "pool_bytes", "misses_on_gpu")


@dataclass(frozen=True)
class Settings:
    """One context's pool (engine/params.py fills it from the plan's fields of the same names,
    which the config's and the tuner Request's also bear)."""
    expert_cache: int  # experts the pool holds (0: every lookup misses)
    expert_cache_swaps: int = 0  # experts taken in a step at most; 0: the engine's default, 4
    # a GPU pool's misses computed by the GPU from RAM (patches/0003)
    expert_misses_on_gpu: bool = False
    expert_cache_device: str = "gpu"  # "cpu": the pool in RAM, not on the first GPU (tests)
    decay: float | None = None  # the use counts' decay per step; None: the engine's, 0.95
    # misses computed against slots of zeros (True) or skipped (False); None: by the pool's
    # device (zero slots on a GPU, whose kernels take no id -1)
    zero_slot: bool | None = None

    def __post_init__(self) -> None:
        if self.expert_cache < 0:
            raise ValueError(f"expert cache slots must be 0 or more, not {self.expert_cache}")
        if self.expert_cache_swaps < 0:
            raise ValueError(f"expert cache swaps must be 0 or more, not {self.expert_cache_swaps}")
        if self.expert_cache_device not in ("gpu", "cpu"):
            raise ValueError(f"expert cache device must be gpu or cpu, not "
                             f"{self.expert_cache_device!r}")


class _Params(ctypes.Structure):
    """struct llama_moe_cache_params (patches/0006, include/llama.h)."""
    _fields_ = [("slots", ctypes.c_int32), ("swaps", ctypes.c_int32), ("decay", ctypes.c_float),
                ("pool_in_ram", ctypes.c_bool), ("misses_on_gpu", ctypes.c_bool),
                ("zero_slot", ctypes.c_int32)]


def _params(settings: Settings | None) -> _Params:
    if settings is None:  # slots < 0: no pool, whatever the environment says
        return _Params(slots=-1, swaps=-1, decay=-1.0, zero_slot=-1)
    # The C struct's fields (patches/0006) are the engine's own names for the same settings:
    # slots is expert_cache, swaps expert_cache_swaps, pool_in_ram expert_cache_device = cpu.
    return _Params(slots=settings.expert_cache, swaps=settings.expert_cache_swaps or -1,
                   decay=-1.0 if settings.decay is None else settings.decay,
                   pool_in_ram=settings.expert_cache_device == "cpu",
                   misses_on_gpu=settings.expert_misses_on_gpu,
                   zero_slot=-1 if settings.zero_slot is None else int(settings.zero_slot))


@dataclass(frozen=True)
class ExpertCacheStats:
    # the runner sends these figures as they are, an event of this kind (engine/runner/protocol.py)
    kind: ClassVar[str] = "expert_cache"
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


def give(settings: Settings | None) -> bool:
    """The contexts this process creates from now on get this pool (None: none, whatever the
    environment says). False when the engine has no such function (built without
    patches/0006): it then makes no pool."""
    fn = _set_params_function()
    if fn is None:
        if settings is not None:
            log.warning("this llama.cpp build takes no expert cache settings (patches/0006): "
                        "no pool")
        return False
    params = _params(settings)
    fn(ctypes.byref(params))  # copied by the engine
    return True


@contextlib.contextmanager
def switched_on(settings: Settings | None) -> Iterator[None]:
    """While it lasts, a context created gets `settings`' pool (None: none); afterwards every
    context gets none."""
    give(settings)
    try:
        yield
    finally:
        give(None)


@functools.cache  # look the symbols up once
def _set_params_function():
    import llama_cpp.llama_cpp as llama_lib

    fn = getattr(llama_lib._lib, "llama_moe_cache_set_params", None)
    if fn is not None:
        fn.argtypes = [ctypes.POINTER(_Params)]
        fn.restype = None
    return fn


@functools.cache  # read after every answer
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
