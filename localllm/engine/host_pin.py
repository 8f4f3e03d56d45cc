"""Pin the model file's mapped pages for the GPU, in place.

A plan on a GPU that keeps weights in RAM reads a long prompt by copying those weights to the GPU
once per micro-batch (llama.cpp's op offload). From the file's mapped pages, which are pageable,
CUDA stages each copy through a bounce buffer at about 7 GB/s; from pinned memory it copies at
PCIe speed (43 GB/s on the H200: lab/runs/h200-2026-12-02-round5b.md). Loading with
`load_mode = none` pins them by copying every byte into a fresh pinned buffer, which made a
load or a fill band switch of Qwen3-30B-A3B take 7.7 s instead of 1.8 s
(lab/runs/h200-2026-12-02-round5d.md). Registering
the mapped range with CUDA (`cudaHostRegister`, read-only) pins the page cache's pages where
they are: the same copies at PCIe speed, with no second copy of the weights.

ggml-cuda exports the registration (`ggml_backend_cuda_register_host_buffer`) but llama.cpp
never calls it, and it acts only while GGML_CUDA_REGISTER_HOST is set.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

log = logging.getLogger("localllm.runner.model")

GATE = "GGML_CUDA_REGISTER_HOST"


def loaded_library(name: str) -> ctypes.CDLL | None:
    """The shared library this process loaded whose file name holds `name` (the same copy, so
    the same CUDA context), or None."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split(maxsplit=5)[-1].strip()
            if name in os.path.basename(path):
                return ctypes.CDLL(path)
    return None


def _cuda_library() -> ctypes.CDLL | None:
    """The ggml CUDA backend this process loaded, or None (a CPU build)."""
    return loaded_library("libggml-cuda")


def mapped_ranges(path: str) -> list[tuple[int, int]]:
    """(start, length) of each stretch of this process's mappings of the file at `path`,
    adjacent mappings merged. llama.cpp unmaps what it uploaded to the GPU, so what is left
    is the weights that stay in RAM (and the header)."""
    real = os.path.realpath(path)
    spans: list[list[int]] = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[5].strip() != real:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if spans and spans[-1][1] == start:
                spans[-1][1] = end
            else:
                spans.append([start, end])
    return [(start, end - start) for start, end in spans]


@dataclass
class PinnedMapping:
    """The file's mapped stretches registered with CUDA; `release` before the model is freed
    (llama.cpp unmaps them then, and a registered range must not be unmapped)."""

    ranges: list[tuple[int, int]] = field(default_factory=list)
    error: str = ""
    _lib: ctypes.CDLL | None = None

    @property
    def pinned_bytes(self) -> int:
        return sum(length for _, length in self.ranges)

    def release(self) -> None:
        if self._lib is None:
            return
        unregister = self._lib.ggml_backend_cuda_unregister_host_buffer
        unregister.argtypes = [ctypes.c_void_p]
        unregister.restype = None
        for start, _ in self.ranges:
            unregister(ctypes.c_void_p(start))
        self.ranges = []
        self._lib = None


def pin_mapped(path: str) -> PinnedMapping:
    """Register every mapped stretch of `path` with CUDA. On failure nothing stays
    registered and `error` says why (no CUDA backend, the driver refused a range)."""
    lib = _cuda_library()
    if lib is None:
        return PinnedMapping(error="no CUDA backend loaded")
    register = lib.ggml_backend_cuda_register_host_buffer
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    register.restype = ctypes.c_bool
    os.environ[GATE] = "1"  # read by ggml-cuda at each call
    pinned = PinnedMapping(_lib=lib)
    for start, length in mapped_ranges(path):
        if not register(ctypes.c_void_p(start), ctypes.c_size_t(length)):
            pinned.release()
            return PinnedMapping(error=f"CUDA refused to pin {length / 2**20:.0f} MiB of "
                                       f"the mapped model file")
        pinned.ranges.append((start, length))
    return pinned
