#!/usr/bin/env python3
"""What a long prompt adds to a CUDA process's memory that no ggml buffer holds: the per-thread
stack (local memory) the driver reserves for every thread the card can hold at once, grown at
the first launch of a kernel that spills more than any before it and never given back.

Loads MODEL with every layer on the GPU, reads a short prompt, decodes, then reads a long
prompt in micro-batches of --ubatch, and prints one JSON line: the stack limit
(cudaLimitStackSize) and the card's used memory (cudaMemGetInfo) after each step, and the
card's SM count and threads per SM, whose product times the stack is the reservation.

    python -m lab.device.cuda_stack_probe MODEL.gguf --ctx 32768 --long 16384 --ubatch 2048
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys

import llama_cpp


from localllm.engine.host_pin import loaded_library


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--long", type=int, default=16384)
    p.add_argument("--ubatch", type=int, default=2048)
    p.add_argument("--kv", default="q4_0")
    a = p.parse_args()
    kv = {"f16": 1, "q8_0": 8, "q4_0": 2}[a.kv]
    llm = llama_cpp.Llama(a.model, n_gpu_layers=-1, n_ctx=a.ctx, n_batch=a.ubatch,
                          n_ubatch=a.ubatch, flash_attn=True, type_k=kv, type_v=kv,
                          verbose=False)
    rt = loaded_library("libcudart.so")  # ggml-cuda's runtime: its primary context
    if rt is None:
        raise SystemExit("error: no libcudart loaded: is this a CUDA build of llama.cpp?")
    attr = ctypes.c_int()
    rt.cudaDeviceGetAttribute(ctypes.byref(attr), 16, 0)  # cudaDevAttrMultiProcessorCount
    sms = attr.value
    rt.cudaDeviceGetAttribute(ctypes.byref(attr), 39, 0)  # MaxThreadsPerMultiProcessor
    threads = attr.value
    steps = []

    def note(step: str) -> None:
        stack, free, total = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        rt.cudaDeviceSynchronize()
        rt.cudaDeviceGetLimit(ctypes.byref(stack), 0)  # cudaLimitStackSize
        rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total))
        steps.append({"step": step, "stack_bytes": stack.value,
                      "used_mib": (total.value - free.value) >> 20})

    rng = random.Random(0)
    vocab = llm.n_vocab()
    note("loaded")
    llm.eval([rng.randrange(100, vocab) for _ in range(200)])
    note("short prompt")
    for _ in range(16):
        llm.eval([rng.randrange(100, vocab)])
    note("decode")
    llm.reset()
    llm.eval([rng.randrange(100, vocab) for _ in range(a.long)])
    note(f"{a.long}-token prompt")
    llm.eval([rng.randrange(100, vocab) for _ in range(20)])
    note("follow-up")
    print(json.dumps({"sms": sms, "threads_per_sm": threads, "ubatch": a.ubatch, "kv": a.kv,
                      "steps": steps}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
