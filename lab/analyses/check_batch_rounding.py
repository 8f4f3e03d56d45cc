#!/usr/bin/env python3
"""Does llama.cpp give the same logits for a token decoded alone and in a batch?

    python -m lab.analyses.check_batch_rounding [--model PATH] [--depth 300] [--batch 5]

Decodes `depth` tokens, then the next `batch` tokens once as one batch and once one at a time
(fresh contexts, same prefix), and prints the largest logit difference, for flash attention
off and on, f16 and f32 KV, with and without weight repacking. A check of speculative drafts
is such a batch: where the difference breaks a near-tie, greedy text with drafts parts from
plain greedy text (see README, speculative decoding).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402  (a CUDA build must load before numpy)
import numpy as np  # noqa: E402


def last_logits(model_path: Path, tokens: list[int], depth: int, batched: bool, flash: int,
                kv_type: int, repack: bool) -> list[np.ndarray]:
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = repack
    model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 1024
    cparams.flash_attn_type, cparams.type_k, cparams.type_v = flash, kv_type, kv_type
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(chunk: list[int], start: int, logits: bool) -> None:
        for i, t in enumerate(chunk):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, logits
        batch.n_tokens = len(chunk)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    decode(tokens[:depth], 0, False)
    tail, out = tokens[depth:], []
    chunks = [tail] if batched else [[t] for t in tail]
    pos = depth
    for chunk in chunks:
        decode(chunk, pos, True)
        for i in range(len(chunk)):
            row = llama_cpp.llama_get_logits_ith(ctx, i)
            out.append(np.ctypeslib.as_array(row, shape=(n_vocab,)).copy())
        pos += len(chunk)
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--depth", type=int, default=300)
    parser.add_argument("--batch", type=int, default=5)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from scripts import fetch_test_models

        model = fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")
    llama_cpp.llama_backend_init()
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(100, 20000, args.depth + args.batch)]
    print(f"{model.name}: the last {args.batch} of {args.depth + args.batch} tokens, batched vs "
          "one at a time")
    print("| flash attention | KV | repacking | largest logit difference |")
    print("| --- | --- | --- | --- |")
    for flash, kv, repack in itertools.product((0, 1), (1, 0), (True, False)):
        runs = [last_logits(model, tokens, args.depth, batched, flash, kv, repack)
                for batched in (True, False)]
        diff = max(float(np.abs(a - b).max()) for a, b in zip(*runs, strict=True))
        print(f"| {'on' if flash else 'off'} | {'f16' if kv == 1 else 'f32'} | "
              f"{'yes' if repack else 'no'} | {diff:.3f} |", flush=True)


if __name__ == "__main__":
    main()
