"""One sequence's KV cells out of a llama.cpp context into RAM, and back into a context.

`save` copies what a sequence holds (`llama_state_seq_get_data`: its KV cells, or its recurrent
state, with their positions) into a `SavedSequence`; `restore` puts it into a sequence of a
context of the same model, KV types and number of sequences (another context, a larger `n_ctx`,
another seq id are all fine; llama.cpp writes one record per KV stream, one per sequence here
since the KV is not unified, and refuses a state whose stream count differs).

The engine keeps its prompt cache with it (`PromptCache`: slots taken for another request keep
their prompt in RAM); a reload can use it to carry a conversation's KV over.

Runs in the runner process, on the thread that drives the context.
"""

from __future__ import annotations

import collections
import ctypes
import time
from dataclasses import dataclass, field

import llama_cpp

from .checkpoints import Checkpoint


@dataclass(eq=False)
class SavedSequence:
    """A sequence's state: the tokens its cells hold (in position order) and llama.cpp's bytes.

    `pos_min` is the lowest position still held (a sliding-window cache has dropped the ones
    before it), read when it was saved. `checkpoints`: the slot's checkpoints of its recurrent
    or sliding-window state (checkpoints.py), which come back with it."""

    tokens: tuple[int, ...]
    data: ctypes.Array
    pos_min: int
    saved_at: float = field(default_factory=time.monotonic)
    checkpoints: tuple[Checkpoint, ...] = ()

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


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Saved sequences within a byte budget, least recently used dropped first.

    `keep_contained`: whether an entry whose tokens are a prefix of a newer entry's is kept.
    With full attention the newer one serves every prompt the older would (restored, it is cut
    back to the shared prefix); a sliding-window or recurrent state can only be continued from
    near its end, so there the shorter one may still be the one that fits."""

    def __init__(self, budget_bytes: int, keep_contained: bool = False):
        self.budget = max(0, budget_bytes)
        self.keep_contained = keep_contained
        self._entries: collections.OrderedDict[int, SavedSequence] = collections.OrderedDict()
        self.used = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[SavedSequence]:
        """Oldest use first."""
        return list(self._entries.values())

    def covers(self, tokens: list[int] | tuple[int, ...]) -> bool:
        """Whether some entry already holds these tokens (as all or the start of its own)."""
        n = len(tokens)
        return any(len(e.tokens) >= n and common_prefix(e.tokens, tokens) == n
                   for e in self._entries.values())

    def put(self, saved: SavedSequence) -> bool:
        """Keep `saved`, dropping the least recently used entries to make room; False when it
        is larger than the whole budget."""
        if saved.nbytes > self.budget:
            return False
        if not self.keep_contained:
            for key, entry in list(self._entries.items()):
                if len(entry.tokens) <= len(saved.tokens) and \
                        common_prefix(entry.tokens, saved.tokens) == len(entry.tokens):
                    self._drop(key)
        while self._entries and self.used + saved.nbytes > self.budget:
            self._drop(next(iter(self._entries)))
        self._entries[id(saved)] = saved
        self.used += saved.nbytes
        return True

    def best(self, tokens: list[int], usable) -> tuple[SavedSequence | None, int]:
        """The entry that gives `tokens` the longest reusable prefix, and that prefix's length.
        `usable(entry, common)` applies the model's reuse rules to a shared prefix."""
        best, best_n = None, 0
        for entry in self._entries.values():
            n = usable(entry, common_prefix(entry.tokens, tokens))
            if n > best_n:
                best, best_n = entry, n
        if best is not None:
            self._entries.move_to_end(id(best))
        return best, best_n

    def _drop(self, key: int) -> None:
        self.used -= self._entries.pop(key).nbytes
