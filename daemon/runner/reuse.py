"""Which KV a new request may keep: the Engine's slot choice and prefix reuse, with the RAM
prompt cache (seqstate.py) and the model's rules (a sliding window, a recurrent state, images
kept whole).

Methods of the runner's Engine (engine.py), kept apart because they own one question: what of
a slot's cache, or of a saved prompt, serves the prompt at hand. They read the engine's model
(`lm`), `prompt_cache` and `drafter`.
"""

from __future__ import annotations

import logging
import time

import llama_cpp

from . import seqstate
from .seqstate import SavedSequence, common_prefix
from .slots import Slot
from .vision import MediaPrompt

log = logging.getLogger("localllm.runner")
# A slot taken for another request is saved to the prompt cache when that request would throw
# away at least this many of its tokens (fewer are cheaper to read again than to copy).
MIN_SAVED_TOKENS = 64
# A saved prompt is restored only when it reuses this many more tokens than the slot itself.
MIN_RESTORE_GAIN = 32


class PromptReuse:
    def _usable_prefix(self, common: int, held: int, pos_min: int, prompt: int,
                       rollback: int) -> int:
        """How much of a cache holding `held` tokens (the lowest position still there:
        `pos_min`) a prompt of `prompt` tokens sharing `common` with it may keep. The prompt's
        last token is always read (its logits are sampled).

        A sliding-window cache keeps only the last `n_swa` positions of its SWA layers: reading
        on from position p needs positions p - n_swa .. p - 1 there, so a prefix whose window
        was overwritten is read again (llama.cpp would accept the cut and read stale cells). A
        recurrent state can be cut back only `rollback` positions, as far as llama.cpp keeps
        snapshots of it (none unless the plan drafts): otherwise only a pure extension is
        reused."""
        common = min(common, prompt - 1)
        if common <= 0:
            return 0
        if self.lm.n_swa and pos_min > max(0, common - self.lm.n_swa):
            return 0
        if self.lm.recurrent and held - common > rollback:
            return 0
        return common

    def _slot_prefix(self, slot: Slot, tokens: list[int],
                     media: MediaPrompt | None = None) -> int:
        pos_min = (llama_cpp.llama_memory_seq_pos_min(self.lm.memory, slot.seq_id)
                   if self.lm.n_swa and slot.tokens else 0)
        common = self._usable_prefix(common_prefix(slot.tokens, tokens), len(slot.tokens),
                                     pos_min, len(tokens), self.lm.n_rollback)
        if self.drafter is not None:
            common = min(common, self.drafter.reusable(slot.seq_id, common))
        return max(0, whole_images(common, media))

    def _choose_slot(self, free: list[Slot], tokens: list[int],
                     media: MediaPrompt | None = None) -> Slot:
        """The free slot whose cache shares the longest prefix, unless taking it would throw
        away more than it reuses (another conversation's prompt): then an empty slot, else the
        least recently used one (whose prompt goes to the prompt cache first)."""
        kept = {slot.seq_id: self._slot_prefix(slot, tokens, media) for slot in free}
        best = max(free, key=lambda s: (kept[s.seq_id], -s.last_used))
        if kept[best.seq_id] >= len(best.tokens) - kept[best.seq_id]:
            return best
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    def _swap_in_saved_prompt(self, slot: Slot, tokens: list[int],
                              media: MediaPrompt | None = None) -> None:
        """Before a request takes `slot`: save what it holds to the prompt cache when the
        request would throw most of it away, and restore a saved prompt into it when one shares
        a longer prefix with the request than the slot itself does.

        A continuation (the next turn of the conversation the slot holds) keeps most of it
        and loses only a tail, which is not worth a copy. A saved prompt is matched by its
        longest common prefix with the request, so a prompt that differs from it late (a
        changed line after the tools) still reuses everything before that line."""
        cache = self.prompt_cache
        if cache is None:
            return
        kept = self._slot_prefix(slot, tokens, media)
        lost = len(slot.tokens) - kept
        if lost >= MIN_SAVED_TOKENS and lost > kept // 4 and not cache.covers(slot.tokens):
            started = time.perf_counter()
            saved = seqstate.save(self.lm.ctx, slot.seq_id, slot.tokens, limit=cache.budget)
            if saved is not None and cache.put(saved):
                log.info("prompt cache: saved %d tokens of slot %d (%.1f MiB) in %.0f ms; "
                         "%d prompts, %.1f of %.1f MiB", len(saved.tokens), slot.seq_id,
                         saved.nbytes / 2**20, (time.perf_counter() - started) * 1e3,
                         len(cache), cache.used / 2**20, cache.budget / 2**20)
        # Restored into a sequence, a recurrent state is exactly its tokens: no rollback.
        entry, common = cache.best(tokens, lambda e, n: whole_images(self._usable_prefix(
            n, len(e.tokens), e.pos_min, len(tokens), rollback=0), media))
        if entry is None or common < kept + MIN_RESTORE_GAIN:
            return
        self._restore(slot, entry, common)

    def _restore(self, slot: Slot, entry: SavedSequence, common: int) -> None:
        started = time.perf_counter()
        if not seqstate.restore(self.lm.ctx, slot.seq_id, entry):
            log.warning("prompt cache: llama.cpp refused a saved prompt of %d tokens",
                        len(entry.tokens))
            slot.tokens.clear()
        else:
            slot.tokens = list(entry.tokens)
            log.info("prompt cache: restored %d tokens into slot %d (%d reused) in %.0f ms",
                     len(entry.tokens), slot.seq_id, common,
                     (time.perf_counter() - started) * 1e3)
        if self.drafter is not None:  # its cache of this sequence held something else
            self.drafter.forget(slot.seq_id, 0)

    def _reuse_prefix(self, slot: Slot, tokens: list[int], media: MediaPrompt | None = None,
                      reuse: bool = True) -> int:
        """Keep the slot's KV for the longest prefix it shares with `tokens` that the model's
        reuse rules allow (`_usable_prefix`); return how many tokens are kept (none without
        `reuse`)."""
        mem, seq = self.lm.memory, slot.seq_id
        common = self._slot_prefix(slot, tokens, media) if reuse else 0
        if common > 0 and llama_cpp.llama_memory_seq_rm(mem, seq, common, -1):
            del slot.tokens[common:]
        else:
            llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
            slot.tokens.clear()
            common = 0
        if self.drafter is not None:
            self.drafter.forget(seq, common)
        return common


def whole_images(common: int, media: MediaPrompt | None) -> int:
    """A reusable prefix cut back to the start of an image it would split: an image's cells
    are kept whole or read again whole."""
    if media is not None and common > 0:
        span = media.span_at(common)
        if span is not None:
            return span.start
    return common
