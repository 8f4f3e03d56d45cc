"""The evaluation, an op of the engine's child program (engine/runner/tuner_ops.py): the
logits of each chunk under the reference and each tested setting, reduced to KL divergence,
top-token agreement and perplexity (profiles/evaluate.py says what is measured and why).
Model and contexts are built by engine/params.py."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import llama_cpp as llama  # before numpy: see engine/runner/tuner_ops.py
from localllm.planner.plan import Plan, physical_cores
from localllm.engine.probes import EvalResult, Evaluate, Evaluation
from localllm.planner.quality import split_kv

from localllm.errors import UserError

from .batch import fill
from .params import context_params, model_params


def run(request: Evaluate, progress: Callable[[int, int], None]) -> Evaluation:
    """`progress(done, total)` as each chunk of the text starts."""
    import numpy as np  # after llama_cpp

    @llama.llama_log_callback
    def quiet(level, text, _user_data):
        pass

    llama.llama_log_set(quiet, ctypes.c_void_p())
    llama.llama_backend_init()
    n_ctx = request.n_ctx

    threads = physical_cores()

    def load(path: str):
        mparams, keep_alive = model_params(Plan(n_ctx=n_ctx,
                                                n_gpu_layers=request.n_gpu_layers))
        model = llama.llama_model_load_from_file(path.encode(), mparams)
        del keep_alive
        if not model:
            raise UserError(f"llama.cpp could not load {path}")
        return model

    def context(model, kv: str):
        type_k, type_v = split_kv(kv)
        # One chunk a decode; flash attention on for every setting: the cache type is the only
        # difference between them.
        plan = Plan(n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, 512), flash_attn=True,
                    type_k=type_k, type_v=type_v, n_threads=threads, n_threads_batch=threads)
        ctx = llama.llama_init_from_model(model, context_params(plan, every_row=True))
        if not ctx:
            raise UserError(f"llama.cpp could not create a context with {kv} KV")
        return ctx

    model = load(request.model_path)
    ref_model = load(request.reference_path) if request.reference_path else model
    vocab = llama.llama_model_get_vocab(model)
    n_vocab = llama.llama_vocab_n_tokens(vocab)
    if ref_model is not model and \
            llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(ref_model)) != n_vocab:
        raise UserError("the reference model has another vocabulary: compare quants of one "
                            "model")
    text = request.text.encode()
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
        fill(batch, chunk, all_logits=True)
        if llama.llama_decode(ctx, batch) != 0:
            raise UserError("llama_decode failed during the evaluation")
        ptr = llama.llama_get_logits(ctx)
        logits = np.ctypeslib.as_array(ptr, shape=(len(chunk), n_vocab))[first:-1].astype(
            np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    first = n_ctx // 2
    ref_ctx = context(ref_model, "f16")
    tested = [(kv, context(model, kv)) for kv in request.settings]
    kl: dict[str, list] = {kv: [] for kv, _ in tested}
    agree = {kv: 0 for kv, _ in tested}
    nll = {kv: 0.0 for kv, _ in tested}
    ref_nll = 0.0
    scored = 0
    for c in range(n_chunks):
        progress(c, n_chunks)
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
        results.append(EvalResult(
            setting=kv, reference=request.reference_name, kl_mean=float(values.mean()),
            kl_p99=float(np.percentile(values, 99)), top_agreement=agree[kv] / scored,
            perplexity=float(np.exp(nll[kv] / scored)),
            reference_perplexity=float(np.exp(ref_nll / scored)), n_tokens=scored))
    return Evaluation(tuple(results))
