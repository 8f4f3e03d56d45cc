#!/usr/bin/env python3
"""Decode with the CPU engine at LLAMA_CPP_LIB_PATH in a child process and say whether it
crashed, on a model with the default model's tensor table (SmolLM2-135M-Instruct Q4_1: llama,
n_embd 576, a Q8_0 token table) and random weights.

    python3 -m lab.device.check_cpu_engine --skeleton FILE  (here: the header of the real file)
    LLAMA_CPP_LIB_PATH=DIR python3 -m lab.device.check_cpu_engine --model /tmp/m.gguf \
        --header skeleton.gguf [--no-extra-bufts]

For engine builds where the real model cannot travel (the GPU machine takes 64 MiB): the AMX
crash of issue #32 came on the first decode of that model with llama.cpp's extra buffer types
on. `--skeleton` keeps the real file's header (metadata, vocabulary, tensor table: 1.8 MB) and
its size; `--header` writes the model from it with random bytes for the weights. Prints one
line of JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import sys
import llama_cpp
llama_cpp.llama_backend_init()
print(llama_cpp.llama_print_system_info().decode(), file=sys.stderr)
mp = llama_cpp.llama_model_default_params()
mp.n_gpu_layers = 0
mp.use_extra_bufts = sys.argv[2] == "1"
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), mp)
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch = 512, 512, 512
cp.n_threads = cp.n_threads_batch = int(sys.argv[3])  # a 2-core CI machine runs 1 or 2
ctx = llama_cpp.llama_init_from_model(model, cp)
tokens = list(range(1, 65))
arr = (llama_cpp.llama_token * len(tokens))(*tokens)
assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(arr, len(tokens))) == 0
for t in range(8):
    one = (llama_cpp.llama_token * 1)(100 + t)
    assert llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(one, 1)) == 0
print("decoded")
"""


def write_skeleton(model: Path, out: Path) -> None:
    """The header of `model` (everything before the tensor data) with the file's size appended
    as 8 bytes."""
    from gguf import GGUFReader

    offset = GGUFReader(str(model)).data_offset
    with open(model, "rb") as f:
        head = f.read(offset)
    out.write_bytes(head + model.stat().st_size.to_bytes(8, "little"))


def from_skeleton(skeleton: Path, out: Path) -> None:
    data = skeleton.read_bytes()
    head, size = data[:-8], int.from_bytes(data[-8:], "little")
    rng = random.Random(0)
    with open(out, "wb") as f:
        f.write(head)
        left = size - len(head)
        while left:
            n = min(left, 1 << 24)
            f.write(rng.randbytes(n))
            left -= n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skeleton", help="write the skeleton of the test model to this file")
    p.add_argument("--model")
    p.add_argument("--header", help="a skeleton to write --model from, when it is not there")
    p.add_argument("--no-extra-bufts", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.skeleton:
        from scripts import fetch_test_models

        write_skeleton(fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf"),
                       Path(args.skeleton))
        return 0
    model = Path(args.model)
    if not model.exists():
        from_skeleton(Path(args.header), model)
    done = subprocess.run([sys.executable, "-c", CHILD, str(model),
                           "0" if args.no_extra_bufts else "1", str(args.threads)],
                          capture_output=True, text=True, timeout=600, env=os.environ)
    system = next((ln for ln in done.stderr.splitlines() if "CPU :" in ln), "")
    print(json.dumps({"lib": os.environ.get("LLAMA_CPP_LIB_PATH", ""),
                      "extra_bufts": not args.no_extra_bufts, "threads": args.threads,
                      "exit": done.returncode,
                      "decoded": "decoded" in done.stdout, "system_info": system.strip(),
                      "stderr_tail": done.stderr[-1500:] if done.returncode else ""}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
