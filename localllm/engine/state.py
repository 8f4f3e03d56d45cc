"""Copies of one sequence's state out of a llama.cpp context into RAM, and back.

`save` / `restore`: everything a sequence holds (`llama_state_seq_get_data`: its KV cells, or
its recurrent state, with their positions) as a `SavedSequence`, restored into a sequence of a
context of the same model, KV types and number of sequences (another context, a larger `n_ctx`,
another seq id are all fine; llama.cpp writes one record per KV stream, one per sequence here
since the KV is not unified, and refuses a state whose stream count differs). The runner's
prompt cache and fill band switch use them (engine/runner/reuse.py, bands.py).

`take` / `load`: a `Checkpoint`, the part that cannot be cut back only
(`LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`: for hybrid memory the recurrent part, for an iSWA cache
the SWA cells); when the runner takes them is engine/runner/checkpoints.py's. A copy into fresh
memory pays a page fault per 4 KiB page, most of its cost: on the H200 a Qwen3.5-35B-A3B state
of 63 MiB took 47 ms, twice per prompt; so a checkpoint that leaves its slot unshared gives its
buffer back (`recycle`) for the next copy (at most `SPARE_BUFFERS` kept, outside the tuner's
count): 7 ms there.

Runs in the runner process, on the thread that drives the context.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from dataclasses import dataclass, field

import llama_cpp

PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
_ORDER = itertools.count()  # the order checkpoints were taken in (the oldest goes first)
SPARE_BUFFERS = 2
_spare: list[bytearray] = []  # buffers of checkpoints that left their slot, pages in place


@dataclass(eq=False)
class Checkpoint:
    """The state that cannot be cut back after reading a sequence's first `n_tokens` tokens."""

    n_tokens: int
    data: ctypes.Array
    kind: str  # END (a prompt's end or one of checkpoints.ends before it) or SPACED
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


def recycle(dropped: list[Checkpoint]) -> None:
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


@dataclass(eq=False)
class SavedSequence:
    """A sequence's state: the tokens its cells hold (in position order) and llama.cpp's bytes.

    `pos_min` is the lowest position still held (a sliding-window cache has dropped the ones
    before it), read when it was saved. `checkpoints`: the slot's checkpoints of its recurrent
    or sliding-window state (engine/runner/checkpoints.py), which come back with it."""

    tokens: tuple[int, ...]
    data: ctypes.Array
    pos_min: int
    saved_at: float = field(default_factory=time.monotonic)
    checkpoints: tuple[Checkpoint, ...] = ()
    # the key of the KV layout it was saved from, where a disk cache may keep it
    # (engine/runner/disk_format.py: a fill band switch may load another layout meanwhile)
    kv_key: str = ""

    @property
    def nbytes(self) -> int:
        """RAM it holds: the state and its checkpoints."""
        return len(self.data) + sum(c.nbytes for c in self.checkpoints)


def state_size(ctx: llama_cpp.llama_context_p, seq_id: int) -> int:
    return int(llama_cpp.llama_state_seq_get_size(ctx, seq_id))


def save(ctx: llama_cpp.llama_context_p, seq_id: int, tokens: list[int] | tuple[int, ...],
         limit: int | None = None,
         checkpoints: tuple[Checkpoint, ...] = ()) -> SavedSequence | None:
    """The state of `seq_id`, whose cells hold `tokens` (with the sequence's `checkpoints`);
    None when it is empty, larger than `limit` bytes, or llama.cpp could not write it."""
    size = state_size(ctx, seq_id)
    if size <= 0 or not tokens or (limit is not None and size > limit):
        return None
    # bytearray(n) takes fresh zero pages from the OS (no memset of gigabytes); the ctypes view
    # shares its memory.
    data = (ctypes.c_uint8 * size).from_buffer(bytearray(size))
    written = llama_cpp.llama_state_seq_get_data(ctx, data, size, seq_id)
    if written != size:
        return None
    pos_min = llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(ctx), seq_id)
    return SavedSequence(tuple(tokens), data, max(0, pos_min), checkpoints=checkpoints)


def restore(ctx: llama_cpp.llama_context_p, seq_id: int, saved: SavedSequence) -> bool:
    """Replace what `seq_id` holds by `saved`. False (and the sequence left empty) when
    llama.cpp refused it (no room, or a context of another model or KV type)."""
    memory = llama_cpp.llama_get_memory(ctx)
    llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
    size = len(saved.data)  # the state itself (nbytes counts its checkpoints too)
    read = llama_cpp.llama_state_seq_set_data(ctx, saved.data, size, seq_id)
    if read != size:
        llama_cpp.llama_memory_seq_rm(memory, seq_id, -1, -1)
        return False
    return True
