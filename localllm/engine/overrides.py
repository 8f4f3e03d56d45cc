"""Tensor placement overrides (llama.cpp's `-ot PATTERN=DEVICE`) through llama-cpp-python.

`llama_model_params.tensor_buft_overrides` exists in the C struct, but the high-level `Llama()`
never sets it. It takes a NULL-terminated array of `{const char *pattern; ggml_backend_buffer_type_t
buft}`; the buffer type of a device comes from libggml (`ggml_backend_dev_by_name` /
`ggml_backend_dev_by_type` + `ggml_backend_dev_buffer_type`). llama.cpp matches each pattern with
`std::regex_search` against tensor names while loading, so the array must stay alive until the
model is loaded.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import lru_cache

from localllm.planner.plan import TensorOverride

GGML_BACKEND_DEVICE_TYPE_CPU = 0


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@lru_cache(maxsize=1)
def _ggml():
    """libggml (device registry) and libggml-base (buffer types) beside the loaded libllama."""
    import llama_cpp.llama_cpp as llama_lib

    directory = os.path.dirname(llama_lib._lib._name)
    registry = ctypes.CDLL(os.path.join(directory, "libggml.so"))
    base = ctypes.CDLL(os.path.join(directory, "libggml-base.so"))
    registry.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    registry.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    registry.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    registry.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    base.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    base.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    return registry, base


def buffer_type(device: str) -> int:
    """The buffer type of a device: "CPU", or a backend device name such as "CUDA0"."""
    registry, base = _ggml()
    if device.upper() == "CPU":
        dev = registry.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
    else:
        dev = registry.ggml_backend_dev_by_name(device.encode())
    if not dev:
        raise ValueError(f"llama.cpp has no device {device!r} in this build")
    buft = base.ggml_backend_dev_buffer_type(dev)
    if not buft:
        raise ValueError(f"device {device!r} has no buffer type")
    return buft


class _Keepalive:
    """Owns the C array and the pattern bytes the model params point to."""

    def __init__(self, array, patterns):
        self.array = array
        self.patterns = patterns


def apply_tensor_overrides(model_params, overrides: Iterable[TensorOverride]) -> _Keepalive | None:
    """Point `model_params.tensor_buft_overrides` at the overrides; keep the returned object
    alive until the model is loaded. Returns None (and changes nothing) for no overrides."""
    overrides = list(overrides)
    if not overrides:
        return None
    patterns = [o.pattern.encode() for o in overrides]
    array = (_BuftOverride * (len(overrides) + 1))()
    for i, (o, pattern) in enumerate(zip(overrides, patterns, strict=True)):
        array[i].pattern = pattern
        array[i].buft = buffer_type(o.device)
    array[len(overrides)].pattern = None
    array[len(overrides)].buft = None
    model_params.tensor_buft_overrides = ctypes.cast(array, ctypes.c_void_p)
    return _Keepalive(array, patterns)


@contextmanager
def tensor_overrides_applied(overrides: Iterable[TensorOverride]) -> Iterator[None]:
    """Within the block, every `Llama(...)` loads with these overrides.

    `Llama.__init__` starts from `llama_model_default_params()` and never touches the overrides
    field, so the defaults it receives here already carry them. Not thread-safe: one load at a
    time (a runner process loads one model)."""
    import llama_cpp.llama_cpp as llama_lib

    original = llama_lib.llama_model_default_params
    keep: list[_Keepalive | None] = []

    def with_overrides():
        params = original()
        keep.append(apply_tensor_overrides(params, overrides))
        return params

    llama_lib.llama_model_default_params = with_overrides
    try:
        yield
    finally:
        llama_lib.llama_model_default_params = original
