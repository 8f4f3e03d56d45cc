"""Checkpoints of the part of a sequence's state that cannot be cut back.

A full-attention KV cache is cut back to any position (`llama_memory_seq_rm`). A recurrent
state (Gated DeltaNet, Mamba: hybrid models keep one beside their attention KV) holds only its
last position, and a sliding-window cache only the last `n_swa` positions of its SWA layers.
An agent that sends its history back changed (a template that drops the earlier turns'
thinking, a client that re-formats tool calls) diverges from the cached sequence near where its
previous prompt ended, behind that window: without a copy of that state the whole prompt is
read again.

So while a prompt is read, the runner copies that state out at a few positions (engine/state.py:
`llama_state_seq_get_data_ext` with `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`: for hybrid memory
the recurrent part only, for an iSWA cache the SWA cells only; llama-memory-hybrid.cpp,
llama-kv-cache-iswa.cpp): at its end and `NEAR_END` tokens before it (a template often
renders the previous answer's opening differently from the generation prompt), a micro-batch
before that (`ends`: a prompt whose last turn is another short one, such as the same system
prompt and tools with a new user message, diverges a few dozen tokens before the end, where a
sliding window or a recurrent state cannot be cut back to), and every `spacing` tokens of a
long prompt. A later prompt that shares a prefix with the slot restores
the latest checkpoint at or before the divergence, the full-attention KV is cut back to the same
position, and the prompt is read from there (reuse.py). llama-server does the same with its
context checkpoints (tools/server/server-context.cpp); this follows its semantics.

The copies live in RAM, at most `MAX_PER_SLOT` per slot; the tuner counts them in the plan's
RAM (planner.memory.checkpoint_bytes, which owns that number); one that leaves its slot and
no saved sequence holds lends its buffer to the next copy (engine/state.py). llama.cpp's
`ON_DEVICE` flag keeps one copy per sequence only (taking another invalidates the first): it
cannot hold several.
"""

from __future__ import annotations

from localllm.engine.state import Checkpoint, recycle
from localllm.planner.memory import CHECKPOINTS_PER_SLOT as MAX_PER_SLOT

NEAR_END = 4  # as llama-server: a checkpoint this many tokens before a prompt's end
END, SPACED = "end", "spaced"


def ends(n_ubatch: int) -> tuple[int, ...]:
    """How many tokens before a prompt's end its END checkpoints are taken, furthest first:
    llama-server's positions (`4 + n_ubatch` and 4, its PR 20288) and the end itself. The one
    a micro-batch back serves a new last turn of up to a micro-batch: without it, the same
    20K-token agent prefix with another user message restarted from the latest spaced
    checkpoint, up to `spacing` tokens back (1,500-3,000 tokens of Gemma 3 read again)."""
    return (NEAR_END + n_ubatch, NEAR_END, 0)


END_PER_PROMPT = len(ends(0))  # the END checkpoints a prompt takes, the latest ones kept


def spacing(n_ctx: int) -> int:
    """Tokens between two checkpoints of one long prompt: an eighth of the context, so that
    the spaced ones cover a whole context, between 256 (a tiny context) and 4096 (each costs a
    copy of the state: about 150 MiB for a Qwen3.5-27B, a few ms)."""
    return max(256, min(4096, n_ctx // 8))


class SlotCheckpoints:
    """One slot's checkpoints, in position order, at most `limit`. When full, the oldest goes
    first among the ends of earlier prompts, then among the spaced ones: the latest prompt's
    end is what the next turn of a conversation needs, the spaced ones what a change early in
    a long prompt (a rewritten system prompt) needs."""

    def __init__(self, limit: int = MAX_PER_SLOT, items: tuple[Checkpoint, ...] = ()):
        self.limit = limit
        self.items: list[Checkpoint] = sorted(items, key=lambda c: c.n_tokens)

    def __len__(self) -> int:
        return len(self.items)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.items)

    def last_at(self, n_tokens: int) -> int:
        """Where the latest checkpoint at or before `n_tokens` is (0 when none)."""
        return max((c.n_tokens for c in self.items if c.n_tokens <= n_tokens), default=0)

    def latest(self, at_most: int) -> Checkpoint | None:
        """The checkpoint closest to `at_most` without passing it."""
        return max((c for c in self.items if 0 < c.n_tokens <= at_most),
                   key=lambda c: c.n_tokens, default=None)

    def add(self, checkpoint: Checkpoint) -> None:
        dropped = [c for c in self.items if c.n_tokens == checkpoint.n_tokens]
        self.items = [c for c in self.items if c.n_tokens != checkpoint.n_tokens]
        while len(self.items) >= self.limit:
            dropped.append(self._evictable(checkpoint))
            self.items.remove(dropped[-1])
        recycle(dropped)
        self.items.append(checkpoint)
        self.items.sort(key=lambda c: c.n_tokens)

    def cut(self, n_tokens: int) -> None:
        """The sequence keeps its first `n_tokens` tokens: checkpoints past them describe
        tokens it no longer holds."""
        recycle([c for c in self.items if c.n_tokens > n_tokens])
        self.items = [c for c in self.items if c.n_tokens <= n_tokens]

    def clear(self) -> None:
        recycle(self.items)
        self.items = []

    def copy(self) -> tuple[Checkpoint, ...]:
        """The checkpoints as they are now (their bytes are shared: a checkpoint never
        changes), for the prompt cache to keep with a saved sequence."""
        for checkpoint in self.items:
            checkpoint.shared = True
        return tuple(self.items)

    def _evictable(self, incoming: Checkpoint) -> Checkpoint:
        by_age = sorted(self.items, key=lambda c: c.order)
        end_kind = [c for c in [*by_age, incoming] if c.kind == END]
        latest_ends = set(map(id, end_kind[-END_PER_PROMPT:]))  # the latest prompt's
        for c in by_age:
            if c.kind == END and id(c) not in latest_ends:
                return c
        spaced = [c for c in by_age if c.kind == SPACED]
        return spaced[0] if spaced else by_age[0]
