#!/usr/bin/env python3
"""Which experts a synthetic MoE model routes to, read from llama.cpp as it runs, and the hit
rate an LRU cache of K experts per block would have had.

    python -m scripts.bench.routing_profile                       # uniform vs zipf, tiny qwen35moe
    python -m scripts.bench.routing_profile --routing "uniform;zipf:1.2" --tokens 4000
    python -m scripts.bench.routing_profile --model some.gguf       # any MoE GGUF

The routing is llama.cpp's own: an eval callback (`cb_eval` in the context parameters) reads
each block's `ffn_moe_topk` tensor, the expert ids chosen per token, while the model reads a
text (teacher forcing, the repository's docs and sources: prose, tables and code). The cache
is simulated per block over that token order: a lookup hits when the expert was among the K
most recently used of that block. Without --model, a tiny model of the shape (--shape) is
written with the real expert count and experts per token, once per --routing spec.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sys
import tempfile
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import llama_cpp  # noqa: E402  (a CUDA build must load before numpy)

from scripts import synth_gguf  # noqa: E402

SIZES = (8, 16, 32, 64, 128)
STATIC = 64  # a fixed set of the most used experts (knowing the whole text): popularity alone
WITHIN = 8  # reuse within this many previous tokens (the published statistics' window)
CACHE_SHARE = 0.4  # an LRU holding this share of a block's experts


def corpus(n_chars: int) -> str:
    """Real text of mixed kinds, the same on every machine with this checkout."""
    parts = []
    for pattern in ("docs/**/*.md", "modelstore/*.py", "profiles/*.py", "localllm/daemon/*.py"):
        parts += [p.read_text(errors="replace") for p in sorted(ROOT.glob(pattern))]
    text = "\n".join(parts)
    while len(text) < n_chars:
        text += text
    return text[:n_chars]


class TopkRecorder:
    """An eval callback that keeps every block's routed expert ids, in token order."""

    def __init__(self, n_used: int) -> None:
        lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
        lib.ggml_get_name.restype = ctypes.c_char_p
        lib.ggml_get_name.argtypes = [ctypes.c_void_p]
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                ctypes.c_size_t]
        self.lib, self.n_used = lib, n_used
        self.blocks: dict[int, list[tuple[int, ...]]] = {}
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, tensor, ask, _user) -> bool:
        name = (self.lib.ggml_get_name(tensor) or b"").decode()
        if not name.startswith("ffn_moe_topk-"):
            return not ask  # not asked for: let it pass; computed: carry on
        if ask:
            return True  # yes: show it to us once computed
        # The top-k is a strided view of the argsort ([k, n_tokens], rows n_expert apart):
        # ne and nb are read from struct ggml_tensor (type, buffer, ne[4], nb[4]).
        header = ctypes.cast(tensor, ctypes.POINTER(ctypes.c_int64 * 10)).contents
        ne0, ne1, nb0, nb1 = header[2], header[3], header[6], header[7]
        nbytes = self.lib.ggml_nbytes(tensor)
        raw = ctypes.create_string_buffer(nbytes)
        self.lib.ggml_backend_tensor_get(tensor, raw, 0, nbytes)
        ids = memoryview(raw.raw).cast("i")
        rows = self.blocks.setdefault(int(name.rsplit("-", 1)[1]), [])
        for j in range(ne1):
            rows.append(tuple(ids[(j * nb1 + i * nb0) // 4] for i in range(ne0)))
        return True


def route(model_path: str, text: str, n_batch: int = 64, answer: int = 0
          ) -> tuple[dict, int, int]:
    """{block: [expert ids per token]}, the expert count and experts per token: `text` read
    in batches of `n_batch`, then `answer` tokens the model chooses greedily, one a step."""
    llama_cpp.llama_backend_init()
    llama_cpp.llama_log_set(_QUIET, None)
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise SystemExit(f"llama.cpp could not load {model_path}")
    arch = _meta(model, "general.architecture")
    n_expert = int(_meta(model, f"{arch}.expert_count") or 0)
    n_used = int(_meta(model, f"{arch}.expert_used_count") or 0)
    if not n_expert:
        raise SystemExit(f"{model_path} is not a mixture of experts")
    vocab = llama_cpp.llama_model_get_vocab(model)
    raw = text.encode()
    tokens = (llama_cpp.llama_token * (len(raw) + 8))()
    n_tok = llama_cpp.llama_tokenize(vocab, raw, len(raw), tokens, len(tokens), True, False)
    recorder = TopkRecorder(n_used)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = n_tok + answer + 16
    cparams.n_batch = cparams.n_ubatch = n_batch
    cparams.cb_eval = recorder.callback
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    try:
        for start in range(0, n_tok, n_batch):
            n = min(n_batch, n_tok - start)
            batch = llama_cpp.llama_batch_get_one(
                ctypes.cast(ctypes.addressof(tokens) + start * 4,
                            ctypes.POINTER(llama_cpp.llama_token)), n)
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
        n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        token = (llama_cpp.llama_token * 1)()
        for _ in range(answer):
            logits = llama_cpp.llama_get_logits_ith(ctx, -1)
            token[0] = max(range(n_vocab), key=logits.__getitem__)
            if llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(token, 1)) != 0:
                raise SystemExit("llama_decode failed on the answer")
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        # llama.cpp's log goes back where the binding sends it: a caller in the same process
        # (the test suite) reads it later
        from llama_cpp._logger import llama_log_callback as binding_logger

        llama_cpp.llama_log_set(binding_logger, ctypes.c_void_p())
    return recorder.blocks, n_expert, n_used


@llama_cpp.llama_log_callback
def _QUIET(level, text, user_data):  # llama.cpp's log would drown the table
    return None


def _meta(model, key: str) -> str | None:
    buf = ctypes.create_string_buffer(256)
    if llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf)) < 0:
        return None
    return buf.value.decode()


def lru_hit_rate(sequence: list[tuple[int, ...]], size: int, counted_from: int = 0) -> float:
    """Hits / lookups of an LRU of `size` experts over one block's routed ids; the tokens
    before `counted_from` (a prompt) only warm it."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0
    for t, ids in enumerate(sequence):
        counted = t >= counted_from
        for e in ids:
            lookups += counted
            if e in cache:
                hits += counted
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > size:
                    cache.popitem(last=False)
    return hits / max(1, lookups)


def profile(blocks: dict, n_expert: int, sizes=SIZES) -> dict:
    """Per cache size, the hit rate over all blocks; plus how skewed popularity is: the share
    of lookups the most used eighth of the experts took, and the mean overlap of a token's
    experts with the previous token's."""
    curve = {}
    for k in sizes:
        if k > n_expert:
            continue
        rates = [lru_hit_rate(seq, k) for seq in blocks.values()]
        curve[k] = sum(rates) / len(rates)
    top, overlap, static, slopes, recent = [], [], [], [], []
    for seq in blocks.values():
        counts = [0] * n_expert
        for ids in seq:
            for e in ids:
                counts[e] += 1
        counts.sort(reverse=True)
        top.append(sum(counts[:max(1, n_expert // 8)]) / max(1, sum(counts)))
        static.append(sum(counts[:STATIC]) / max(1, sum(counts)))
        slopes.append(_zipf_exponent(counts))
        pairs = [len(set(a) & set(b)) / len(a) for a, b in zip(seq, seq[1:], strict=False)]
        overlap.append(sum(pairs) / max(1, len(pairs)))
        recent.append(reuse_within(seq, WITHIN))
    share = max(1, round(n_expert * CACHE_SHARE))
    forty = [lru_hit_rate(seq, share) for seq in blocks.values()]
    return {"lru": curve, "top_eighth_share": sum(top) / len(top),
            f"within{WITHIN}": sum(recent) / len(recent),
            "lru_40pct": sum(forty) / len(forty), "lru_40pct_slots": share,
            f"static_{STATIC}": sum(static) / len(static),
            "zipf_exponent": sum(slopes) / len(slopes),
            "next_token_overlap": sum(overlap) / len(overlap),
            "tokens": len(next(iter(blocks.values()))), "blocks": len(blocks)}


def reuse_within(sequence: list[tuple[int, ...]], window: int) -> float:
    """The mean share of a token's experts that any of the `window` tokens before it used."""
    shares = []
    for t in range(1, len(sequence)):
        seen = set().union(*sequence[max(0, t - window):t])
        shares.append(sum(e in seen for e in sequence[t]) / len(sequence[t]))
    return sum(shares) / max(1, len(shares))


def _zipf_exponent(counts: list[int]) -> float:
    """Least-squares slope of log(uses) over log(rank), ranks 1..n/4 (the head, where the
    counts are large enough to read): 0 for uniform, about 1 for Zipf's law."""
    head = [c for c in counts[:max(2, len(counts) // 4)] if c > 0]
    x = [math.log(r + 1) for r in range(len(head))]
    y = [math.log(c) for c in head]
    mx, my = sum(x) / len(x), sum(y) / len(y)
    var = sum((a - mx) ** 2 for a in x) or 1.0
    return -sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / var


def tiny_moe(shape: str, blocks: int = 0) -> synth_gguf.ShapeConfig:
    """The shape at toy width with its real expert count and experts per token; `blocks` > 0
    gives it that many blocks (the real depth: skew that fades with depth shows there)."""
    real = synth_gguf.SHAPES[shape]
    if not real.n_expert:
        raise SystemExit(f"{shape} is not a mixture of experts")
    # 16 wide at the real depth: 48 blocks of 512 experts stay a file of a few hundred MB.
    # The real head size and rotary dimensions: local routing's attention window is made of
    # the rotary frequencies, which they decide.
    config = replace(synth_gguf.tiny(real), n_expert=real.n_expert,
                     n_expert_used=real.n_expert_used, n_ff_expert=16 if blocks else 32,
                     head_dim=real.head_dim, rope_dims=real.rope_dims)
    return replace(config, n_layer=blocks) if blocks else config


def per_block(blocks: dict, size: int) -> list[float]:
    """The LRU hit rate of each block, in block order."""
    return [lru_hit_rate(blocks[b], size) for b in sorted(blocks)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen35-35b-a3b")
    p.add_argument("--model", help="profile this GGUF instead of writing tiny ones")
    p.add_argument("--routing", default="uniform;zipf:1",
                   help="specs separated by ;, each uniform, balanced, zipf:S, local:G,S or real "
                        "(synth_gguf --routing)")
    p.add_argument("--fill", default="noise", choices=("noise", "random"))
    p.add_argument("--tokens", type=int, default=3000, help="about this many tokens of text")
    p.add_argument("--blocks", type=int, default=0,
                   help="toy models with this many blocks (default: the toy's 4)")
    p.add_argument("--per-block", type=int, metavar="K", default=0,
                   help="also print each block's hit rate with an LRU of K")
    p.add_argument("--sizes", default="", metavar="K,K...",
                   help="also the LRU hit rate with these cache sizes (slots a block)")
    p.add_argument("--json", action="store_true", help="one JSON line per profile")
    args = p.parse_args(argv)
    text = corpus(args.tokens)  # the synthetic vocabulary reads about one token per character
    runs = []
    if args.model:
        runs.append((args.model, args.model))
    else:
        tmp = Path(tempfile.mkdtemp(prefix="routing-"))
        config = tiny_moe(args.shape, args.blocks)
        for spec in args.routing.split(";"):
            path = tmp / f"{config.name}-{spec.replace(':', '_')}.gguf"
            synth_gguf.write_gguf(path, config, "Q8_0", args.fill, routing=spec)
            runs.append((spec, str(path)))
    print(f"{'routing':22} " + " ".join(f"LRU{k:>4}" for k in SIZES)
          + f"  static{STATIC}  top 1/8  next  within{WITHIN}  LRU 40%  exponent")
    for label, path in runs:
        blocks, n_expert, _ = route(path, text)
        result = profile(blocks, n_expert)
        if args.per_block:
            result[f"per_block_lru{args.per_block}"] = per_block(blocks, args.per_block)
        extra = [int(k) for k in args.sizes.split(",") if k.strip()]
        result["lru_at"] = profile(blocks, n_expert, extra)["lru"] if extra else {}
        if args.json:
            print(json.dumps({"routing": label, **result}))
            continue
        cells = " ".join(f"{result['lru'][k]:7.1%}" if k in result["lru"] else "      -"
                         for k in SIZES)
        print(f"{label:22} {cells}  {result[f'static_{STATIC}']:7.1%}  "
              f"{result['top_eighth_share']:7.1%} {result['next_token_overlap']:5.1%}  "
              f"{result[f'within{WITHIN}']:7.1%}  {result['lru_40pct']:7.1%}  "
              f"{result['zipf_exponent']:5.2f}")
        if result["lru_at"]:
            print(f"{'':22} LRU " + "  ".join(f"{k}: {r:.1%}" for k, r in result["lru_at"].items()))
        if args.per_block:
            rates = result[f"per_block_lru{args.per_block}"]
            print(f"{'':22} LRU{args.per_block} by block: "
                  + " ".join(f"{r:.0%}" for r in rates))
    return 0


if __name__ == "__main__":
    sys.exit(main())
