"""The model a runner serves, with everything bound to it: its context of `n_parallel`
sequences, the tokenizer, the batch each decode step fills, the drafter (the model's MTP layers
or a draft model), the vision projector, made on first use an embedding context, and each
request's sampler (a llama.cpp sampler chain holds the model's vocabulary: a reload rebuilds
the samplers of the requests in flight).

`LoadedModel` owns their lifecycle (load, free, reload with another plan for a fill band
switch) and the llama.cpp calls the runner's slot loop makes on the target context (decode,
cut a sequence, sample), so the loop (engine/runner/) deals in slots and requests, not in
llama.cpp handles.

A request's sampler chain follows Ollama's and llama.cpp's order: penalties, grammar, then
top-k, typical, top-p, min-p, temperature and the random draw. The penalty sampler is fed the
prompt first, as Ollama does, so a repeat penalty also covers what the user wrote. Greedy
decoding with nothing else in the chain skips llama.cpp's candidate array (a copy of the whole
vocabulary per token) and takes the argmax of the logits in place.

Runs inside the runner process only.
"""

from __future__ import annotations

import ctypes
import logging
import random

import llama_cpp
import numpy as np
from localllm.planner.plan import Plan

from localllm.options import SamplingOptions

from . import expert_cache
from .drafters import DraftModel, MTPDrafter, load_drafter
from .embedding import Embedder
from .model import (
    LlamaModel,
    ModelLoadError,
    RequestError,
    Tokenizer,
    batch_capacity,
    free,
    load,
)
from .vision import Vision

log = logging.getLogger("localllm.runner.model")


class LoadedModel:
    def __init__(self, model_path: str, plan: Plan, *, draft_model_path: str | None = None,
                 projector_path: str | None = None, vocab_slack: int = 0):
        """Load the model as `plan` says, its drafter when the plan drafts with one ("mtp":
        its own NextN layers; "draft": the model at `draft_model_path`, whose vocabulary may
        differ from the model's by `vocab_slack` tokens) and the projector at
        `projector_path`. ModelLoadError when llama.cpp refuses any of them."""
        self.path = model_path
        self.lm: LlamaModel = load(model_path, plan)
        self.plan = plan  # the plan `lm` was loaded with (the prompt cache's key reads it)
        self.tokenizer = Tokenizer(self.lm.model, self.lm.vocab)
        self.batch_capacity = batch_capacity(self.lm)
        self.batch = llama_cpp.llama_batch_init(self.batch_capacity, 0, 1)
        self._rows = batch_rows(self.batch)
        self.drafter: MTPDrafter | DraftModel | None = load_drafter(
            self.lm, plan, self.batch_capacity, draft_model_path, vocab_slack)
        self.vision: Vision | None = None
        if projector_path:
            try:
                self.vision = Vision(projector_path, self.lm.model,
                                     use_gpu=plan.n_gpu_layers > 0 and plan.projector_on_gpu,
                                     n_threads=plan.n_threads_batch, flash_attn=plan.flash_attn)
            except ValueError as e:
                raise ModelLoadError(str(e)) from None
        self._embedder: Embedder | None = None

    def embedder(self, n_ctx: int, plan: Plan) -> Embedder:
        """Embeddings in a context of their own on the same weights, made on first use."""
        if self._embedder is None:
            arch = self.tokenizer.metadata("general.architecture") or ""
            pooling = self.tokenizer.metadata(f"{arch}.pooling_type")
            self._embedder = Embedder(self.lm.model, n_ctx, plan.n_threads,
                                      plan.n_threads_batch,
                                      int(pooling) if pooling is not None else None,
                                      plan.n_ubatch)
        return self._embedder

    def reload(self, plan: Plan) -> None:
        """Give back the context and the weights (their VRAM and RAM) and load the same file
        as `plan` says: a fill band switch (no drafter or projector is loaded then). On
        ModelLoadError nothing is loaded: the caller loads a plan that fit before."""
        if self._embedder is not None:
            self._embedder.close()
            self._embedder = None
        free(self.lm)
        self.lm = load(self.path, plan)
        self.plan = plan
        self.tokenizer = Tokenizer(self.lm.model, self.lm.vocab)
        if batch_capacity(self.lm) > self.batch_capacity:
            llama_cpp.llama_batch_free(self.batch)
            self.batch_capacity = batch_capacity(self.lm)
            self.batch = llama_cpp.llama_batch_init(self.batch_capacity, 0, 1)
            self._rows = batch_rows(self.batch)

    # ---- the slot loop's calls on the target context ------------------------------------
    def sampler(self, options: SamplingOptions, grammar: str | None, prompt: list[int],
                n_ctx: int) -> Sampler:
        """A request's sampler on this model's vocabulary (RequestError: the grammar does not
        parse); `prompt` feeds the penalties."""
        return Sampler(self.lm.vocab, self.lm.n_vocab, options, grammar, prompt, n_ctx)

    def decode(self) -> int:
        """Decode the batch as filled (0: done; llama_decode's code otherwise)."""
        return llama_cpp.llama_decode(self.lm.ctx, self.batch)

    def put(self, n: int, token: int, pos: int, seq: int, logits: bool) -> int:
        """Row `n` of the batch: `token` at `pos` of sequence `seq`; the next row's index."""
        tokens, positions, n_seq_ids, seq_ids, wants_logits = self._rows
        tokens[n] = token
        positions[n] = pos
        n_seq_ids[n] = 1
        seq_ids[n][0] = seq
        wants_logits[n] = logits
        return n + 1

    def cut(self, seq: int, keep: int) -> bool:
        """Drop sequence `seq`'s cells from position `keep` on (-1: all of them)."""
        return bool(llama_cpp.llama_memory_seq_rm(self.lm.memory, seq, keep, -1))

    def pos_min(self, seq: int) -> int:
        """The lowest position sequence `seq` still holds (a sliding window drops the rest)."""
        return llama_cpp.llama_memory_seq_pos_min(self.lm.memory, seq)

    def set_threads(self, n_threads: int, n_threads_batch: int) -> None:
        llama_cpp.llama_set_n_threads(self.lm.ctx, n_threads, n_threads_batch)

    def threads(self) -> tuple[int, int]:
        """(decode threads, prompt threads) as the target context holds them."""
        return (llama_cpp.llama_n_threads(self.lm.ctx),
                llama_cpp.llama_n_threads_batch(self.lm.ctx))

    def expert_cache_stats(self) -> expert_cache.ExpertCacheStats | None:
        """The target context's expert cache figures so far (None: it has no pool)."""
        return expert_cache.read(self.lm.ctx)

    @property
    def n_ctx_train(self) -> int:
        return llama_cpp.llama_model_n_ctx_train(self.lm.model)


def batch_rows(batch) -> tuple:
    """The batch's row arrays, read once: each `batch.token` makes a new ctypes pointer, and
    a decode step fills a row per token on the path between two llama_decode calls."""
    return batch.token, batch.pos, batch.n_seq_id, batch.seq_id, batch.logits


class Sampler:
    def __init__(self, vocab, n_vocab: int, options: SamplingOptions, grammar: str | None,
                 prompt: list[int], n_ctx: int):
        self.n_vocab = n_vocab
        self._row_type = ctypes.c_float * n_vocab
        self.chain = llama_cpp.llama_sampler_chain_init(
            llama_cpp.llama_sampler_chain_default_params())
        last_n = n_ctx if options.repeat_last_n < 0 else options.repeat_last_n
        penalize = last_n > 0 and (options.repeat_penalty != 1.0
                                   or options.frequency_penalty != 0.0
                                   or options.presence_penalty != 0.0)
        self.greedy = options.temperature <= 0
        self.fast_greedy = self.greedy and not penalize and not grammar
        if penalize:
            penalties = llama_cpp.llama_sampler_init_penalties(
                n_vocab, last_n, options.repeat_penalty, options.frequency_penalty,
                options.presence_penalty)
            for token in prompt[-last_n:]:
                llama_cpp.llama_sampler_accept(penalties, token)
            self._add(penalties)
        if grammar:
            compiled = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode(), b"root")
            if not compiled:
                self.free()
                raise RequestError("the grammar does not parse (GBNF with a 'root' rule)")
            self._add(compiled)
        if self.greedy:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        if options.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(options.top_k))
        if 0 < options.typical_p < 1:
            self._add(llama_cpp.llama_sampler_init_typical(options.typical_p, 1))
        if 0 < options.top_p < 1:
            self._add(llama_cpp.llama_sampler_init_top_p(options.top_p, 1))
        if options.min_p > 0:
            self._add(llama_cpp.llama_sampler_init_min_p(options.min_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(options.temperature))
        seed = options.seed if options.seed is not None and options.seed >= 0 \
            else random.getrandbits(31)
        self._add(llama_cpp.llama_sampler_init_dist(seed))

    def _add(self, sampler) -> None:
        llama_cpp.llama_sampler_chain_add(self.chain, sampler)

    def logits(self, ctx, index: int) -> np.ndarray:
        """The logits of batch row `index`, in place (valid until the next decode)."""
        pointer = llama_cpp.llama_get_logits_ith(ctx, index)
        # a ctypes array type made once: np.ctypeslib.as_array builds one on every call
        row = self._row_type.from_address(ctypes.addressof(pointer.contents))
        return np.frombuffer(row, dtype=np.float32)

    def sample(self, ctx, index: int) -> int:
        """The next token from batch row `index`; the chain also records it (penalties,
        grammar state)."""
        if self.fast_greedy:
            return int(self.logits(ctx, index).argmax())
        return llama_cpp.llama_sampler_sample(self.chain, ctx, index)

    def accept(self, token: int) -> None:
        """Record a token chosen earlier (a sampler rebuilt mid-answer catches up)."""
        llama_cpp.llama_sampler_accept(self.chain, token)

    def free(self) -> None:
        if self.chain:
            llama_cpp.llama_sampler_free(self.chain)
            self.chain = None


def log_probs(logits: np.ndarray, token: int, top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's log-probability of `token` and its `top_n` likeliest tokens (raw logits,
    before the sampler's temperature and cuts, as OpenAI reports them)."""
    top = logits.max()
    log_sum = float(top + np.log(np.exp(logits - top).sum()))
    chosen = float(logits[token]) - log_sum
    if top_n <= 0:
        return chosen, []
    best = np.argpartition(-logits, top_n)[:top_n]
    best = best[np.argsort(-logits[best])]
    return chosen, [(int(t), float(logits[t]) - log_sum) for t in best]
