"""Drafters that run a model: MTP (the target's own NextN layers) and a separate draft model.

Both propose greedy drafts for several sequences at once: one `llama_decode` carries every
sequence's inputs, then each further draft token is one more decode of one token per sequence.
The target checks the drafts with the request's own sampler (the runner's engine), so what a
drafter proposes changes the speed, never the text.

MTP. A NextN block predicts the token after next from the token at position p and the target's
last hidden state at p - 1. llama.cpp runs it in a second context (`LLAMA_CONTEXT_TYPE_MTP`,
sharing the model's weights) with a KV cache of its own for that block, which must hold every
position the target holds: after each target step the new positions are fed to it with the
target's hidden states of that step (`observe`), and the token the target just sampled is fed
last, with logits: its argmax is the first draft. Later drafts chain the block's own hidden state.

A draft model is a small model with the same vocabulary in a context of its own; it catches up
on whatever the target committed since it last drafted (its own cache keeps the common prefix),
then drafts greedily.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np
from localllm.planner.plan import Plan

from . import model as llama
from .params import context_params, load_mode

log = logging.getLogger("localllm.runner")


class DraftModelError(Exception):
    """The draft model cannot draft for this target (load failed, vocabularies differ)."""


@dataclass
class Want:
    """One sequence that wants `n` drafts at most: `tokens` are those the target holds (its
    slot's list, not a copy), `pending` the token it just sampled, decoded next."""

    seq: int
    tokens: list[int]
    pending: int
    n: int

    def at(self, pos: int) -> int:
        return self.tokens[pos] if pos < len(self.tokens) else self.pending


@dataclass
class _Input:
    seq: int
    pos: int
    token: int
    hidden: np.ndarray | None  # MTP: the target's hidden state at pos - 1
    logits: bool = False


class _BatchDrafter:
    """A context of `n_seq` sequences and a batch that may carry embeddings beside tokens."""

    def __init__(self, ctx, model, n_seq: int, capacity: int, n_embd: int = 0):
        self.ctx = ctx
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.n_seq = n_seq
        self.capacity = capacity
        self.n_embd = n_embd
        self.batch = llama_cpp.llama_batch_init(capacity, n_embd, 1)
        self.hidden_out: dict[int, np.ndarray] = {}  # MTP: the state after a seq's last row
        if n_embd:  # llama_batch_init leaves `token` NULL when it allocates embeddings
            self._tokens = (llama_cpp.llama_token * capacity)()
            self.batch.token = self._tokens
            self._embd = np.ctypeslib.as_array(self.batch.embd, shape=(capacity, n_embd))

    def _decode(self, inputs: list[_Input]) -> dict[int, int]:
        """Decode `inputs` (in batches of `capacity`); the argmax after each input marked for
        logits, by sequence; the block's own hidden state of those rows is kept for chaining."""
        argmax: dict[int, int] = {}
        for start in range(0, len(inputs), self.capacity):
            chunk = inputs[start:start + self.capacity]
            b = self.batch
            for i, item in enumerate(chunk):
                b.token[i] = item.token
                b.pos[i] = item.pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = item.seq
                b.logits[i] = item.logits
                if self.n_embd:
                    self._embd[i] = 0.0 if item.hidden is None else item.hidden
            b.n_tokens = len(chunk)
            code = llama_cpp.llama_decode(self.ctx, b)
            if code != 0:
                raise RuntimeError(f"the drafter's llama_decode failed ({code})")
            for i, item in enumerate(chunk):
                if item.logits:
                    row = llama_cpp.llama_get_logits_ith(self.ctx, i)
                    argmax[item.seq] = int(np.ctypeslib.as_array(row, shape=(self.n_vocab,))
                                           .argmax())
                    if self.n_embd:
                        h = llama_cpp_ext().llama_get_embeddings_nextn_ith(self.ctx, i)
                        self.hidden_out[item.seq] = np.ctypeslib.as_array(
                            h, shape=(self.n_embd,)).copy()
        return argmax

    def _chain(self, drafts: dict[int, list[int]], wants: dict[int, int],
               next_pos: dict[int, int]) -> None:
        """Draft on, one token per sequence per decode, until each has its `wants`."""
        while True:
            inputs = [_Input(seq, next_pos[seq], d[-1], self.hidden_out.get(seq), True)
                      for seq, d in drafts.items() if len(d) < wants[seq]]
            if not inputs:
                return
            for item in inputs:
                next_pos[item.seq] += 1
            for seq, token in self._decode(inputs).items():
                drafts[seq].append(token)

    def close(self) -> None:
        if self.n_embd:
            self.batch.token = ctypes.POINTER(llama_cpp.llama_token)()
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)


def llama_cpp_ext():
    """llama.cpp's NextN entry points (not in its stable C API; imported only for MTP)."""
    from llama_cpp import llama_cpp_ext as ext

    return ext


class MTPDrafter(_BatchDrafter):
    kind = "mtp"

    def __init__(self, lm: llama.LlamaModel, plan: Plan, capacity: int):
        ext = llama_cpp_ext()
        cparams = context_params(plan, lm.n_seq, capacity)
        cparams.n_rs_seq = 0  # the target's state keeps the snapshots, not the drafter's
        cparams.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
        cparams.ctx_other = lm.ctx
        ctx = llama_cpp.llama_init_from_model(lm.model, cparams)
        if not ctx:
            raise llama.ModelLoadError("llama.cpp could not create the MTP context (see the "
                                       "runner log)")
        n_embd = llama_cpp.llama_model_n_embd(lm.model)
        super().__init__(ctx, lm.model, lm.n_seq, capacity, n_embd)
        self.target_ctx = lm.ctx
        ext.llama_set_embeddings_nextn(lm.ctx, True, False)  # every row's hidden state
        ext.llama_set_embeddings_nextn(ctx, True, True)  # only rows with logits
        self.fed = [0] * lm.n_seq  # the MTP cache holds positions [0, fed) of each sequence
        self.hidden_prev = np.zeros((lm.n_seq, n_embd), dtype=np.float32)  # at fed - 1
        self.queue: list[_Input] = []
        self._target_hidden: np.ndarray | None = None

    def reusable(self, seq: int, common: int) -> int:
        """How much of a shared prefix the target may keep: position p of the MTP cache needs
        the target's hidden state at p - 1, which only a decode of p - 1 gives back, so the
        target reads the last shared token again (and the MTP cache must cover it)."""
        return max(0, min(common - 1, self.fed[seq] - 1))

    def forget(self, seq: int, keep: int) -> None:
        """The target keeps `keep` positions of `seq` and decodes on from there."""
        self.fed[seq] = min(self.fed[seq], keep + 1) if keep else 0
        llama_cpp.llama_memory_seq_rm(self.memory, seq, self.fed[seq], -1)
        if not keep:
            self.hidden_prev[seq] = 0.0
        self.queue = [item for item in self.queue if item.seq != seq]

    def start_step(self, n_tokens: int) -> None:
        """After the target's decode: its hidden states, valid until its next decode."""
        h = llama_cpp_ext().llama_get_embeddings_nextn(self.target_ctx)
        self._target_hidden = np.ctypeslib.as_array(h, shape=(n_tokens, self.n_embd))

    def observe(self, seq: int, first_pos: int, committed: Sequence[int], row0: int,
                pending: int | None) -> None:
        """The target's step put `committed` at `first_pos`.. (batch rows row0..) into its
        cache and sampled `pending` after them (None when it did not): queue what the MTP cache
        can now take."""
        hidden = self._target_hidden
        end = first_pos + len(committed)
        for pos in range(max(self.fed[seq], first_pos), end + (pending is not None)):
            token = committed[pos - first_pos] if pos < end else pending
            h = (hidden[row0 + pos - 1 - first_pos] if pos > first_pos
                 else self.hidden_prev[seq].copy())
            self.queue.append(_Input(seq, pos, token, h))
        if committed:
            self.hidden_prev[seq] = hidden[row0 + len(committed) - 1]
        self.fed[seq] = max(self.fed[seq], end + (pending is not None))

    def draft(self, wants: list[Want]) -> dict[int, list[int]]:
        """Feed what the target's last step added; draft for `wants` (whose last fed input is
        their pending token)."""
        last = {item.seq: item for item in self.queue}
        n_by_seq = {}
        for want in wants:
            item = last.get(want.seq)
            if want.n > 0 and item is not None and item.pos == len(want.tokens):
                item.logits = True
                n_by_seq[want.seq] = want.n
            # else out of step with the target (its cache was cut): no drafts this time
        inputs, self.queue = self.queue, []
        if not inputs:
            return {}
        first = self._decode(inputs)
        drafts = {seq: [token] for seq, token in first.items() if seq in n_by_seq}
        next_pos = {seq: self.fed[seq] for seq in drafts}
        self._chain(drafts, n_by_seq, next_pos)
        for seq in drafts:  # the drafts' own cells leave the MTP cache
            llama_cpp.llama_memory_seq_rm(self.memory, seq, self.fed[seq], -1)
        return drafts


class DraftModel(_BatchDrafter):
    kind = "draft"

    def __init__(self, path: str, target: llama.LlamaModel, plan: Plan, capacity: int,
                 vocab_slack: int):
        """`vocab_slack`: how many more or fewer tokens its vocabulary may have than the
        target's (the ids they share must mean the same text)."""
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = plan.draft_n_gpu_layers
        mparams.load_mode = load_mode(plan)
        model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
        if not model:
            raise DraftModelError(f"llama.cpp could not load the draft model {path}")
        try:
            _check_vocab(target, model, vocab_slack)
        except DraftModelError:
            llama_cpp.llama_model_free(model)
            raise
        cparams = context_params(plan, target.n_seq, capacity)
        cparams.n_rs_seq = 0  # drafts are taken back by common prefix, not by snapshots
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            llama_cpp.llama_model_free(model)
            raise DraftModelError("llama.cpp could not create the draft model's context")
        super().__init__(ctx, model, target.n_seq, capacity)
        self.model = model
        self.target_vocab = target.n_vocab
        self.tokens: list[list[int]] = [[] for _ in range(target.n_seq)]  # in its cache
        # tokens[seq][:same[seq]] are known to equal the target's: only the rest is compared
        # (the target only appends, takes back its last drafts, or starts a new request)
        self.same = [0] * target.n_seq

    def reusable(self, seq: int, common: int) -> int:
        return common  # it catches up by itself

    def forget(self, seq: int, keep: int) -> None:
        self.same[seq] = min(self.same[seq], keep)

    def draft(self, wants: list[Want]) -> dict[int, list[int]]:
        inputs: list[_Input] = []
        n_by_seq = {}
        for want in wants:
            if want.n <= 0:
                continue
            held, end = self.tokens[want.seq], len(want.tokens) + 1
            common = self.same[want.seq]
            limit = min(len(held), end - 1)  # the pending token is read again: its logits
            while common < limit and held[common] == want.at(common):
                common += 1
            if not llama_cpp.llama_memory_seq_rm(self.memory, want.seq, common, -1):
                llama_cpp.llama_memory_seq_rm(self.memory, want.seq, -1, -1)
                common = 0
            del held[common:]
            inputs += [_Input(want.seq, pos, want.at(pos), None, pos == end - 1)
                       for pos in range(common, end)]
            held.extend(want.at(pos) for pos in range(common, end))
            self.same[want.seq] = end
            n_by_seq[want.seq] = want.n
        if not inputs:
            return {}
        drafts = {seq: [token] for seq, token in self._decode(inputs).items()}
        next_pos = {seq: len(self.tokens[seq]) for seq in drafts}
        self._chain(drafts, n_by_seq, next_pos)
        for seq, d in drafts.items():
            self.tokens[seq].extend(d[:-1])  # in its cache now (the last one never decoded)
            cut = next((i for i, t in enumerate(d) if t >= self.target_vocab), len(d))
            drafts[seq] = d[:cut]
        return drafts

    def close(self) -> None:
        super().close()
        llama_cpp.llama_model_free(self.model)


def _check_vocab(target: llama.LlamaModel, model, vocab_slack: int) -> None:
    """Drafts are token ids: the two vocabularies must give the same ids the same text."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_draft = llama_cpp.llama_vocab_n_tokens(vocab)
    if abs(n_draft - target.n_vocab) > vocab_slack:
        raise DraftModelError(f"the draft model has {n_draft} tokens, the model "
                              f"{target.n_vocab}: they do not share a vocabulary")
    if llama_cpp.llama_vocab_type(vocab) != llama_cpp.llama_vocab_type(target.vocab):
        raise DraftModelError("the draft model's tokenizer is of another type")
    theirs, ours = llama.Tokenizer(model, vocab), llama.Tokenizer(target.model, target.vocab)
    for token in range(0, min(n_draft, target.n_vocab), 97):
        if theirs.token_bytes(token, special=True) != ours.token_bytes(token, special=True):
            raise DraftModelError(f"token {token} differs between the draft model and the "
                                  f"model: they do not share a vocabulary")


# The drafter each mode loaded with the model runs (localllm.speculative: Mode.loaded).
DRAFTERS = {
    "mtp": lambda lm, plan, capacity, path, slack: MTPDrafter(lm, plan, capacity),
    "draft": lambda lm, plan, capacity, path, slack: DraftModel(path, lm, plan, capacity, slack),
}


def load_drafter(lm: llama.LlamaModel, plan: Plan, capacity: int,
                 draft_model_path: str | None = None,
                 vocab_slack: int = 0) -> MTPDrafter | DraftModel | None:
    """The drafter the plan's mode loads with the model; None for one drafting from the text.
    `vocab_slack`: how far a draft model's vocabulary may differ in size (DraftModel)."""
    row = plan.draft_mode
    if not row.loaded:
        return None
    if row.draft_model and not draft_model_path:
        raise llama.ModelLoadError("the plan drafts with a draft model but none was given "
                                   "(pair one: options.draft_model or the catalog's draft)")
    return DRAFTERS[row.name](lm, plan, capacity, draft_model_path, vocab_slack)
