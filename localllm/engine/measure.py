"""`tune --measure`'s benchmark, an op of the engine's child program (engine/runner/tuner_ops.py):
the model and context loaded from the plan by the runner's own load (engine/model.py: the weights
in RAM pinned in place, the expert pool), then a prompt read and a greedy decode timed over a
bare llama_decode loop; with an expert pool, its hits too."""

from __future__ import annotations

import time
from dataclasses import asdict

import llama_cpp  # before numpy: with a CUDA build, numpy loaded first crashes the model load
from localllm.engine.probes import Measure, Measurement

from . import expert_cache, nvml
from .batch import fill
from .model import free, load


def run(request: Measure) -> Measurement:
    import numpy as np

    plan, decode_tokens = request.plan, request.decode_tokens
    lm = load(request.model_path, plan)  # ModelLoadError says what llama.cpp refused
    ctx, n_vocab = lm.ctx, lm.n_vocab
    prompt_tokens = max(8, min(request.prompt_tokens, plan.n_ctx - decode_tokens - 8))
    # Ordinary token ids past the specials: any text-like sequence times the same.
    tokens = [(7 + 31 * i) % max(1, n_vocab - 300) + 259 for i in range(prompt_tokens)]
    batch = llama_cpp.llama_batch_init(max(plan.n_batch, 1), 0, 1)
    start = time.perf_counter()
    for at in range(0, len(tokens), plan.n_batch):
        fill(batch, tokens[at:at + plan.n_batch], at)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed while reading the prompt")
    prefill_s = time.perf_counter() - start
    position, start = len(tokens), time.perf_counter()
    for _ in range(decode_tokens):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        fill(batch, [int(logits.argmax())], position)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed while decoding")
        position += 1
    decode_s = time.perf_counter() - start
    vram = nvml.process_vram_bytes()
    pool = expert_cache.read(ctx)  # None without a pool
    llama_cpp.llama_batch_free(batch)
    free(lm)
    return Measurement(prompt_tokens / prefill_s, decode_tokens / decode_s, vram, prompt_tokens,
                       decode_tokens, expert_cache=asdict(pool) if pool else None)
