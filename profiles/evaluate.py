"""What a KV cache setting (or another quant) costs in output quality, measured with llama.cpp.

As `llama-perplexity --kl-divergence` does: the text is cut into chunks of n_ctx tokens, each
starting with BOS; every chunk is decoded once with the reference (f16 KV, or another file of the
same model) and once per tested setting, and the second half of each chunk is scored (those
tokens see at least n_ctx / 2 of context, which is where a quantized cache is read most). Per
scored token: the KL divergence of the tested next-token distribution from the reference's,
whether the two agree on the most likely token, and the tested log-likelihood of the real next
token (perplexity).

The logits come from llama.cpp's low-level API in a child process (`python -m
localllm.profiles.evaluate`, request as JSON on stdin, result as JSON on stdout), as for
`tune --measure`: a CUDA build must not share a process with the daemon or with numpy loaded
first.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import UserError

TEXT = Path(__file__).resolve().parent / "eval_text.txt"
DEFAULT_CTX = 512


@dataclass(frozen=True)
class EvalResult:
    setting: str  # "q8_0" (KV) or "f16" for the other model
    reference: str  # "f16" (KV of the same model) or the other model's name
    kl_mean: float
    kl_p99: float
    top_agreement: float  # fraction of scored tokens whose most likely next token agrees
    perplexity: float
    reference_perplexity: float
    n_tokens: int  # scored tokens


def evaluate_in_child(model_path: str, settings: list[str], text: str, n_ctx: int = DEFAULT_CTX,
                      reference_path: str | None = None, reference_name: str = "f16",
                      n_gpu_layers: int = 999, timeout: float = 1800) -> list[EvalResult]:
    request = json.dumps({"model": model_path, "reference_model": reference_path,
                          "settings": settings, "text": text, "n_ctx": n_ctx,
                          "n_gpu_layers": n_gpu_layers})
    proc = subprocess.run([sys.executable, "-m", "localllm.profiles.evaluate"], input=request,
                          text=True, capture_output=True, timeout=timeout)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        last = lines[-1] if lines else f"exit {proc.returncode}"
        raise UserError(f"the evaluation failed: {last.removeprefix('Error: ')}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return [EvalResult(setting=r["setting"], reference=reference_name,
                       **{k: r[k] for k in ("kl_mean", "kl_p99", "top_agreement", "perplexity",
                                           "reference_perplexity", "n_tokens")})
            for r in out["results"]]


# ---- the child -----------------------------------------------------------------------------

def _child(request: dict) -> dict:
    import ctypes

    import llama_cpp.llama_cpp as llama  # before numpy: see the module docstring
    import numpy as np

    from .dryrun import GGML_TYPES
    from .quality import split_kv

    @llama.llama_log_callback
    def quiet(level, text, user_data):
        pass

    llama.llama_log_set(quiet, ctypes.c_void_p())
    llama.llama_backend_init()
    n_ctx = int(request["n_ctx"])

    def load(path: str):
        mp = llama.llama_model_default_params()
        mp.n_gpu_layers = int(request["n_gpu_layers"])
        model = llama.llama_model_load_from_file(path.encode(), mp)
        if not model:
            raise UserError(f"llama.cpp could not load {path}")
        return model

    def context(model, kv: str):
        type_k, type_v = split_kv(kv)
        cp = llama.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_ctx
        cp.n_ubatch = min(n_ctx, 512)
        cp.n_seq_max = 1
        cp.flash_attn_type = 1  # on for every setting: the cache type is the only difference
        cp.type_k = GGML_TYPES[type_k]
        cp.type_v = GGML_TYPES[type_v]
        ctx = llama.llama_init_from_model(model, cp)
        if not ctx:
            raise UserError(f"llama.cpp could not create a context with {kv} KV")
        return ctx

    model = load(request["model"])
    ref_model = load(request["reference_model"]) if request.get("reference_model") else model
    vocab = llama.llama_model_get_vocab(model)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    if ref_model is not model and \
            llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(ref_model)) != n_vocab:
        raise UserError("the reference model has another vocabulary: compare quants of one "
                            "model")
    text = request["text"].encode()
    buf = (llama.llama_token * (len(text) + 8))()
    n = llama.llama_tokenize(vocab, text, len(text), buf, len(buf), False, False)
    tokens = list(buf[:max(0, n)])
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 1:
        raise UserError(f"the text has {len(tokens)} tokens: it needs at least {n_ctx} (one "
                        "chunk); use a longer --file or a smaller --ctx")
    bos = llama.llama_vocab_bos(vocab)
    batch = llama.llama_batch_init(n_ctx, 0, 1)

    def logprobs(ctx, chunk: list[int]):
        llama.llama_memory_clear(llama.llama_get_memory(ctx), True)
        batch.n_tokens = len(chunk)
        for i, tok in enumerate(chunk):
            batch.token[i] = tok
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        if llama.llama_decode(ctx, batch) != 0:
            raise UserError("llama_decode failed during the evaluation")
        ptr = llama.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(len(chunk), n_vocab))[first:-1].astype(
            np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    first = n_ctx // 2
    ref_ctx = context(ref_model, "f16")
    tested = [(kv, context(model, kv)) for kv in request["settings"]]
    kl: dict[str, list] = {kv: [] for kv, _ in tested}
    agree = {kv: 0 for kv, _ in tested}
    nll = {kv: 0.0 for kv, _ in tested}
    ref_nll = 0.0
    scored = 0
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        if bos >= 0:
            chunk[0] = bos
        targets = np.array(chunk[first + 1:])
        ref = logprobs(ref_ctx, chunk)
        rows = np.arange(len(targets))
        ref_nll -= ref[rows, targets].sum()
        ref_p = np.exp(ref)
        ref_top = ref.argmax(axis=1)
        for kv, ctx in tested:
            test = logprobs(ctx, chunk)
            kl[kv].append((ref_p * (ref - test)).sum(axis=1))
            agree[kv] += int((test.argmax(axis=1) == ref_top).sum())
            nll[kv] -= test[rows, targets].sum()
        scored += len(targets)
    results = []
    for kv, _ in tested:
        values = np.maximum(np.concatenate(kl[kv]), 0.0)
        results.append({
            "setting": kv, "kl_mean": float(values.mean()),
            "kl_p99": float(np.percentile(values, 99)),
            "top_agreement": agree[kv] / scored,
            "perplexity": float(np.exp(nll[kv] / scored)),
            "reference_perplexity": float(np.exp(ref_nll / scored)), "n_tokens": scored,
        })
    return {"results": results}


def main() -> int:
    try:
        print(json.dumps(_child(json.loads(sys.stdin.read()))))
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
