#!/usr/bin/env python3
"""Greedy decode with llama.cpp's low-level API and print the tokens and the expert cache's
figures as one JSON line (tests/test_expert_cache.py runs it in a child process, once per
cache setting: the options are the engine's expert cache settings, engine/expert_cache.py, given
to the context it creates; without --slots it has no pool).

    python -m scripts.moe_cache_check MODEL.gguf --slots 8 --pool-in-ram \\
        --prompt 40 --tokens 24
    # a CUDA build: every layer on the GPU but the experts, a pool of 512 slots there
    python -m scripts.moe_cache_check MODEL.gguf --gpu --threads 16 --slots 512

The prompt is token ids (one batch, 32 or more tokens: the cache serves only smaller batches);
then one token per decode. --verify K decodes the generated tokens again K at a time, as a
speculative verification batch would, and reports every row's greedy token (a batch's
arithmetic may differ from a one-token step's: compare it with the same run without the
cache). Weights stay in plain host buffers (no CPU repacking), as the cache needs.

Greedy tokens agree only while no two logits come within the arithmetic's rounding of each
other, and an expert computed on the GPU rounds differently from the CPU's (ggml-cuda quantizes
the activations to q8_1, the CPU to q8_0): on random weights near ties are common. So
`--force RUN.json` decodes another run's tokens instead of its own choices and records each
step's top logits, and `--compare A.json B.json` says, step by step over the same tokens, how
often the two picked the same token and how far their top logits moved:

    python -m scripts.moe_cache_check MODEL.gguf --gpu > off.json
    python -m scripts.moe_cache_check MODEL.gguf --gpu --slots 16 \
        --force off.json > on.json
    python -m scripts.moe_cache_check --compare off.json on.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import llama_cpp  # (a CUDA build must load before numpy)
import numpy as np




def _argmax(ctx, i: int, n_vocab: int) -> int:
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
    return int(np.argmax(logits))


def _decode(ctx, tokens: list[int], pos: int, all_logits: bool) -> None:
    from localllm.engine.batch import fill

    batch = llama_cpp.llama_batch_init(len(tokens), 0, 1)
    try:
        fill(batch, tokens, pos, all_logits=all_logits)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise SystemExit("error: llama_decode failed")
    finally:
        llama_cpp.llama_batch_free(batch)


TOP = 8  # logits kept per step for --compare


def _top(ctx, i: int, n_vocab: int) -> list[tuple[int, float]]:
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
    ids = np.argsort(logits)[::-1][:TOP]
    return [(int(t), float(logits[t])) for t in ids]


def compare(a: dict, b: dict) -> dict:
    """Step by step over the same tokens (b forced with a's, or both forced alike): the share of
    steps whose greedy token agrees, and the largest move of a's top logits in b, relative to
    the spread of a's top logits at that step."""
    tops_a, tops_b = a["top"], b["top"]
    steps = min(len(tops_a), len(tops_b))
    same = sum(tops_a[i][0][0] == tops_b[i][0][0] for i in range(steps))
    moved = []
    for i in range(steps):
        in_b = dict(tops_b[i])
        spread = tops_a[i][0][1] - tops_a[i][-1][1] or 1.0
        moved += [abs(v - in_b[t]) / spread for t, v in tops_a[i] if t in in_b]
    return {"steps": steps, "same_greedy": round(same / steps, 4) if steps else None,
            "max_rel_move": round(max(moved), 4) if moved else None,
            "mean_rel_move": round(sum(moved) / len(moved), 5) if moved else None}


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--compare"]:
        if len(argv) != 3:
            raise SystemExit("usage: moe_cache_check.py --compare A.json B.json")
        a, b = (json.loads(Path(f).read_text().splitlines()[-1]) for f in argv[1:])
        print(json.dumps(compare(a, b)))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=40, help="prompt length in tokens")
    p.add_argument("--tokens", type=int, default=24, help="tokens to generate")
    p.add_argument("--verify", type=int, default=0, help="re-decode the output K at a time")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--force", type=Path, help="decode this run's tokens (its JSON), not ours")
    p.add_argument("--gpu", action="store_true",
                   help="all layers on the GPU, the MoE experts in RAM (-ot exps=CPU)")
    cache = p.add_argument_group("the expert cache (localllm/engine/expert_cache.py Settings)")
    cache.add_argument("--slots", type=int, help="a pool of this many experts (default: none)")
    cache.add_argument("--swaps", type=int, default=0, help="experts taken in a step at most")
    cache.add_argument("--pool-in-ram", action="store_true", help="the pool in RAM, not on a GPU")
    cache.add_argument("--misses-on-gpu", action="store_true",
                       help="a GPU pool's misses computed by the GPU from RAM (patches/0003)")
    cache.add_argument("--zero-slot", type=int, choices=(0, 1),
                       help="misses on slots of zeros (1) or skipped (0); default: by device")
    args = p.parse_args(argv)


    from localllm.engine import expert_cache

    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    mparams.use_extra_bufts = False
    mparams.n_gpu_layers = 999 if args.gpu else 0
    keep = None
    if args.gpu:
        from localllm.engine.overrides import apply_tensor_overrides
        from localllm.planner.plan import TensorOverride

        experts = TensorOverride(r"\.ffn_(up|gate|down)_exps\.weight$", "CPU")
        keep = apply_tensor_overrides(mparams, [experts])
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), mparams)
    del keep  # the override patterns are read while loading only
    if not model:
        raise SystemExit(f"error: could not load {args.model}")
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 512
    cparams.n_batch = 512
    cparams.n_ubatch = 512
    cparams.n_threads = cparams.n_threads_batch = args.threads
    settings = None if args.slots is None else expert_cache.Settings(
        expert_cache=args.slots, expert_cache_swaps=args.swaps,
        expert_cache_device="cpu" if args.pool_in_ram else "gpu",
        expert_misses_on_gpu=args.misses_on_gpu,
        zero_slot=None if args.zero_slot is None else bool(args.zero_slot))
    with expert_cache.switched_on(settings):
        ctx = llama_cpp.llama_init_from_model(model, cparams)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))

    prompt = [(7 * i + 3) % (n_vocab - 10) + 5 for i in range(args.prompt)]
    forced = json.loads(args.force.read_text().splitlines()[-1])["tokens"] if args.force else None
    _decode(ctx, prompt, 0, False)
    top = [_top(ctx, -1, n_vocab)]
    out = [forced[0] if forced else top[-1][0][0]]
    pos = len(prompt)
    started = time.perf_counter()
    for step in range(1, len(forced) if forced else args.tokens):
        _decode(ctx, [out[-1]], pos, False)
        pos += 1
        top.append(_top(ctx, -1, n_vocab))
        out.append(forced[step] if forced else top[-1][0][0])
    steps_single = len(out) - 1
    seconds = time.perf_counter() - started
    stats_single = expert_cache.read(ctx)

    verify_argmax = []
    if args.verify:
        # the same continuation again, K tokens a batch, from just after the prompt
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), 0, len(prompt), -1)
        pos = len(prompt)
        for start in range(0, len(out), args.verify):
            chunk = out[start:start + args.verify]
            _decode(ctx, chunk, pos, True)
            verify_argmax += [_argmax(ctx, i, n_vocab) for i in range(len(chunk))]
            pos += len(chunk)

    stats = expert_cache.read(ctx)
    print(json.dumps({
        "tokens": out, "steps": steps_single, "verify_argmax": verify_argmax, "top": top,
        "decode_tok_s": round(steps_single / seconds, 1) if seconds > 0 else None,
        "stats_single": stats_single.__dict__ if stats_single else None,
        "stats": stats.__dict__ if stats else None,
    }))
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
