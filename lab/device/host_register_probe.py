#!/usr/bin/env python3
"""What registering host memory with CUDA costs in device memory: the card's used memory
(cudaMemGetInfo) before and after `cudaHostRegister` of a file's mapped pages, for each size,
with and without cudaHostRegisterMapped (the flags patches/0003 gives ggml's registration).

A plan that keeps experts in RAM registers the model file's mapped pages (engine/host_pin.py);
this measures whether that registration takes VRAM the planner must price. The pages are a
sparse file's (page cache, 4 KiB pages, as a model file's are); nothing is written to disk.

    python -m lab.device.host_register_probe --sizes 1,4,16,40 --dir /tmp
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys
import tempfile

import llama_cpp


from localllm.engine.host_pin import loaded_library

PORTABLE, MAPPED, READ_ONLY = 1, 2, 8


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,4,16,40", help="GiB, comma-separated")
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args()
    llama_cpp.llama_backend_init()
    if not llama_cpp.llama_supports_gpu_offload():
        raise SystemExit("error: a CPU build of llama.cpp: no CUDA to measure")
    rt = loaded_library("libcudart.so") or ctypes.CDLL("libcudart.so")
    rt.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    rt.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    rt.cudaSetDevice(0)
    rt.cudaFree(None)  # the primary context, before the first reading

    def used_mib() -> float:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        rt.cudaDeviceSynchronize()
        rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        return (total.value - free.value) / (1 << 20)

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    rows = []
    for gib in (float(s) for s in a.sizes.split(",")):
        size = int(gib * (1 << 30))
        with tempfile.TemporaryFile(dir=a.dir) as f:
            f.truncate(size)
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise SystemExit(f"error: mmap of {gib} GiB: {os.strerror(ctypes.get_errno())}")
            for name, flags in (("portable,read-only", PORTABLE | READ_ONLY),
                                ("portable,read-only,mapped", PORTABLE | READ_ONLY | MAPPED)):
                before = used_mib()
                err = rt.cudaHostRegister(address, size, flags)
                after = used_mib()
                if err == 0:
                    rt.cudaHostUnregister(address)
                released = used_mib()
                rows.append({"gib": gib, "flags": name, "error": err,
                             "added_mib": round(after - before, 1),
                             "left_after_unregister_mib": round(released - before, 1)})
                print(json.dumps(rows[-1]), flush=True)
            libc.munmap(address, size)
    print(json.dumps({"rows": rows, "page_size": os.sysconf("SC_PAGE_SIZE")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
