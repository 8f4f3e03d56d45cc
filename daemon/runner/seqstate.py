"""The prompt cache: the prompts of slots taken for other requests, kept in RAM as saved
sequences (llama/state.py's `save` copies a sequence's KV cells or recurrent state out of the
context; `restore` puts them into a sequence of a context of the same model and KV types), so
a conversation whose slot was lent out gets its prompt back instead of reading it again.

Runs in the runner process, on the thread that drives the context.
"""

from __future__ import annotations

import collections

from localllm.llama.state import SavedSequence


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
