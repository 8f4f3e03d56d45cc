"""The model a runner serves, with everything bound to it: its context of `n_parallel`
sequences, the tokenizer, the batch each decode step fills, the drafter (the model's MTP layers
or a draft model), the vision projector and, made on first use, an embedding context.

`LoadedModel` owns their lifecycle (load, free, reload with another plan for a fill band
switch) and the llama.cpp calls the runner's slot loop makes on the target context, so the
loop (daemon/runner/) deals in slots and requests, not in llama.cpp handles.

Runs inside the runner process only.
"""

from __future__ import annotations

import logging

import llama_cpp
from localllm.profiles.planning.plan import Plan

from . import expert_cache
from .drafters import DraftModel, MTPDrafter, load_drafter
from .embedding import Embedder
from .model import LlamaModel, ModelLoadError, Tokenizer, batch_capacity, free, load
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
        self.tokenizer = Tokenizer(self.lm.model, self.lm.vocab)
        self.batch_capacity = batch_capacity(self.lm)
        self.batch = llama_cpp.llama_batch_init(self.batch_capacity, 0, 1)
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
                                      int(pooling) if pooling is not None else None)
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
        self.tokenizer = Tokenizer(self.lm.model, self.lm.vocab)
        if batch_capacity(self.lm) > self.batch_capacity:
            llama_cpp.llama_batch_free(self.batch)
            self.batch_capacity = batch_capacity(self.lm)
            self.batch = llama_cpp.llama_batch_init(self.batch_capacity, 0, 1)

    # ---- the slot loop's calls on the target context ------------------------------------
    def decode(self) -> int:
        """Decode the batch as filled (0: done; llama_decode's code otherwise)."""
        return llama_cpp.llama_decode(self.lm.ctx, self.batch)

    def put(self, n: int, token: int, pos: int, seq: int, logits: bool) -> int:
        """Row `n` of the batch: `token` at `pos` of sequence `seq`; the next row's index."""
        batch = self.batch
        batch.token[n] = token
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq
        batch.logits[n] = logits
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
