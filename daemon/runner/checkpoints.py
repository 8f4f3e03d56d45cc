"""Checkpoints of the part of a sequence's state that cannot be cut back.

A full-attention KV cache is cut back to any position (`llama_memory_seq_rm`). A recurrent
state (Gated DeltaNet, Mamba: hybrid models keep one beside their attention KV) holds only its
last position, and a sliding-window cache only the last `n_swa` positions of its SWA layers.
An agent that sends its history back changed (a template that drops the earlier turns'
thinking, a client that re-formats tool calls) diverges from the cached sequence near where its
previous prompt ended, behind that window: without a copy of that state the whole prompt is
read again.

So while a prompt is read, the runner copies that state out at a few positions
(`llama_state_seq_get_data_ext` with `LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`: for hybrid memory
the recurrent part only, for an iSWA cache the SWA cells only; llama-memory-hybrid.cpp,
llama-kv-cache-iswa.cpp): `NEAR_END` tokens before its end and at its end (a template often
renders the previous answer's opening differently from the generation prompt), and every
`spacing` tokens of a long prompt. A later prompt that shares a prefix with the slot restores
the latest checkpoint at or before the divergence, the full-attention KV is cut back to the same
position, and the prompt is read from there (reuse.py). llama-server does the same with its
context checkpoints (tools/server/server-context.cpp); this follows its semantics.

The copies live in RAM, at most `MAX_PER_SLOT` per slot; the tuner counts them in the plan's
RAM (profiles.memory.checkpoint_bytes, which owns that number). A copy into fresh memory pays a
page fault per 4 KiB page, most of its cost: on the H200 a Qwen3.5-35B-A3B state of 63 MiB took
47 ms, twice per prompt; so a checkpoint that leaves its slot unshared gives its buffer back
for the next one (at most `SPARE_BUFFERS` kept, outside the tuner's count). llama.cpp's
`ON_DEVICE` flag keeps one copy per sequence only (taking another invalidates the first): it
cannot hold several.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass, field

import llama_cpp
from localllm.profiles.planning.memory import CHECKPOINTS_PER_SLOT as MAX_PER_SLOT

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
NEAR_END = 4  # as llama-server: a checkpoint this many tokens before a prompt's end
END, SPACED = "end", "spaced"
_ORDER = itertools.count()  # the order checkpoints were taken in (the oldest goes first)
SPARE_BUFFERS = 2
_spare: list[bytearray] = []  # buffers of checkpoints that left their slot, pages in place


def spacing(n_ctx: int) -> int:
    """Tokens between two checkpoints of one long prompt: an eighth of the context, so that
    the spaced ones cover a whole context, between 256 (a tiny context) and 4096 (each costs a
    copy of the state: about 150 MiB for a Qwen3.5-27B, a few ms)."""
    return max(256, min(4096, n_ctx // 8))


@dataclass(eq=False)
class Checkpoint:
    """The state that cannot be cut back after reading a sequence's first `n_tokens` tokens."""

    n_tokens: int
    data: ctypes.Array
    kind: str  # END (a prompt's end or NEAR_END before it) or SPACED
    order: int = field(default_factory=lambda: next(_ORDER))
    shared: bool = False  # a saved sequence holds it too: its buffer is never reused
    buffer: bytearray | None = field(default=None, repr=False)  # the memory under `data`

    @property
    def nbytes(self) -> int:
        return len(self.data)


def take(ctx: llama_cpp.llama_context_p, seq_id: int, n_tokens: int,
         kind: str) -> Checkpoint | None:
    """The partial state of `seq_id`, which holds `n_tokens` tokens; None when llama.cpp has
    nothing to give or could not write it."""
    size = int(llama_cpp.llama_state_seq_get_size_ext(ctx, seq_id, PARTIAL))
    if size <= 0:
        return None
    buffer = _buffer(size)
    data = (ctypes.c_uint8 * size).from_buffer(buffer)
    if llama_cpp.llama_state_seq_get_data_ext(ctx, data, size, seq_id, PARTIAL) != size:
        return None
    return Checkpoint(n_tokens, data, kind, buffer=buffer)


def _buffer(size: int) -> bytearray:
    for i, spare in enumerate(_spare):
        if len(spare) == size:
            return _spare.pop(i)
    return bytearray(size)


def _recycle(dropped: list[Checkpoint]) -> None:
    """Keep the buffers of checkpoints no one else holds, for the next copy (see the top)."""
    for checkpoint in dropped:
        if not checkpoint.shared and checkpoint.buffer is not None:
            _spare.insert(0, checkpoint.buffer)
    del _spare[SPARE_BUFFERS:]


def load(ctx: llama_cpp.llama_context_p, seq_id: int, checkpoint: Checkpoint) -> bool:
    """Put the checkpoint's state into `seq_id` (its full-attention KV is left as it is: the
    caller cuts it back to `checkpoint.n_tokens`). False when llama.cpp refused it."""
    read = llama_cpp.llama_state_seq_set_data_ext(ctx, checkpoint.data, checkpoint.nbytes,
                                                  seq_id, PARTIAL)
    return read == checkpoint.nbytes


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
        _recycle(dropped)
        self.items.append(checkpoint)
        self.items.sort(key=lambda c: c.n_tokens)

    def cut(self, n_tokens: int) -> None:
        """The sequence keeps its first `n_tokens` tokens: checkpoints past them describe
        tokens it no longer holds."""
        _recycle([c for c in self.items if c.n_tokens > n_tokens])
        self.items = [c for c in self.items if c.n_tokens <= n_tokens]

    def clear(self) -> None:
        _recycle(self.items)
        self.items = []

    def copy(self) -> tuple[Checkpoint, ...]:
        """The checkpoints as they are now (their bytes are shared: a checkpoint never
        changes), for the prompt cache to keep with a saved sequence."""
        for checkpoint in self.items:
            checkpoint.shared = True
        return tuple(self.items)

    def _evictable(self, incoming: Checkpoint) -> Checkpoint:
        by_age = sorted(self.items, key=lambda c: c.order)
        ends = [c for c in [*by_age, incoming] if c.kind == END]
        latest_ends = set(map(id, ends[-2:]))  # the latest prompt's end and near-end
        for c in by_age:
            if c.kind == END and id(c) not in latest_ends:
                return c
        spaced = [c for c in by_age if c.kind == SPACED]
        return spaced[0] if spaced else by_age[0]
