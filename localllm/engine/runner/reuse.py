"""Which KV a new request may keep: the RunnerEngine's slot choice and prefix reuse, with the RAM
prompt cache (`PromptCache`, below), the prompt cache on disk behind it (disk_cache.py), the
checkpoints of a recurrent or sliding-window state (checkpoints.py) and the model's rules (a
sliding window, a recurrent state, images kept whole).

One object the runner's RunnerEngine (engine.py) holds, because it owns one question: what of a
slot's cache, or of a saved prompt, serves the prompt at hand; and, while a prompt is read,
which checkpoints a later prompt may need.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

from localllm.engine import state
from localllm.engine.loaded import LoadedModel
from localllm.engine.state import Checkpoint, SavedSequence
from localllm.engine.vision import MediaPrompt

from .checkpoints import END, SPACED, SlotCheckpoints, ends
from .slots import Slot

log = logging.getLogger("localllm.runner")
# A slot taken for another request is saved to the prompt cache when that request would throw
# away at least this many of its tokens (fewer are cheaper to read again than to copy).
MIN_SAVED_TOKENS = 64
# A saved prompt is restored only when it reuses this many more tokens than the slot itself.
MIN_RESTORE_GAIN = 32


@dataclass(frozen=True)
class Kept:
    """What a request keeps of its slot: `tokens` of its prompt, from `source` ("slot": the
    slot's own KV cut back; "checkpoint": cut back to a checkpoint; "prompt cache": a saved
    prompt restored into the slot first; "" when nothing), the checkpoint's position if one
    was restored."""

    tokens: int
    source: str
    checkpoint: int | None = None


# ---- the prompt cache ----------------------------------------------------------------------
# The prompts of slots taken for other requests, kept in RAM as saved sequences (engine/state.py's
# `save` copies a sequence's KV cells or recurrent state out of the context; `restore` puts them
# into a sequence of a context of the same model and KV types), so a conversation whose slot was
# lent out gets its prompt back instead of reading it again.
def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PromptCache:
    """Saved sequences within a byte budget, least recently used dropped first (to `on_evict`,
    the disk cache's, where there is one).

    `keep_contained`: whether an entry whose tokens are a prefix of a newer entry's is kept.
    With full attention the newer one serves every prompt the older would (restored, it is cut
    back to the shared prefix); a sliding-window or recurrent state can only be continued from
    near its end, so there the shorter one may still be the one that fits."""

    def __init__(self, budget_bytes: int, keep_contained: bool = False, on_evict=None):
        self.budget = max(0, budget_bytes)
        self.keep_contained = keep_contained
        self.on_evict = on_evict  # called with each entry dropped for room
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
            evicted = self._drop(next(iter(self._entries)))
            if self.on_evict is not None:
                self.on_evict(evicted)
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

    def _drop(self, key: int) -> SavedSequence:
        entry = self._entries.pop(key)
        self.used -= entry.nbytes
        return entry


class PromptReuse:
    def __init__(self, model: LoadedModel, prompt_cache: PromptCache | None, disk,
                 checkpoint_spacing: int):
        """`prompt_cache`: saved prompts of slots taken for other requests (None: none kept);
        `checkpoint_spacing`: tokens between checkpoints of a long prompt (0: the model, of
        full attention only, needs none); `disk`: the prompt cache on disk (disk_cache.py's
        DiskCache, which imports this module; None: none)."""
        self.model = model
        self.prompt_cache = prompt_cache
        self.checkpoint_spacing = checkpoint_spacing
        self.disk = disk
        if disk is not None and prompt_cache is not None:
            prompt_cache.on_evict = self._to_disk

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
        if self.model.lm.n_swa and pos_min > max(0, common - self.model.lm.n_swa):
            return 0
        if self.model.lm.recurrent and held - common > rollback:
            return 0
        return common

    def _slot_reuse(self, slot: Slot, tokens: list[int],
                    media: MediaPrompt | None = None) -> tuple[int, Checkpoint | None]:
        """How many of the slot's tokens a prompt of `tokens` may keep, and the checkpoint to
        restore first (None: the slot's state is cut back as it is). A checkpoint serves when
        it is at or before the divergence and further on than the state itself reaches."""
        pos_min = (self.model.pos_min(slot.seq_id)
                   if self.model.lm.n_swa and slot.tokens else 0)
        shared = common_prefix(slot.tokens, tokens)
        common = self._usable_prefix(shared, len(slot.tokens), pos_min, len(tokens),
                                     self.model.lm.n_rollback)
        reach = min(shared, len(tokens) - 1)  # the last prompt token is always read
        if self.model.drafter is not None:
            common = min(common, self.model.drafter.reusable(slot.seq_id, common))
            reach = self.model.drafter.reusable(slot.seq_id, reach)
        common = max(0, whole_images(common, media))
        if not self.checkpoint_spacing:  # the model takes no checkpoints: a slot holds none
            return common, None
        checkpoint = slot.checkpoints.latest(whole_images(reach, media))
        if checkpoint is not None and checkpoint.n_tokens > common:
            return checkpoint.n_tokens, checkpoint
        return common, None

    def _slot_prefix(self, slot: Slot, tokens: list[int],
                     media: MediaPrompt | None = None) -> int:
        return self._slot_reuse(slot, tokens, media)[0]

    def _saved_prefix(self, entry: SavedSequence, shared: int, tokens: list[int],
                      media: MediaPrompt | None) -> int:
        """`_slot_reuse` for a saved prompt sharing `shared` tokens with the request.
        Restored into a sequence, a recurrent state is exactly its tokens: no rollback. None
        of a prompt longer than the loaded fill band holds (saved before a move down)."""
        if len(entry.tokens) >= self.model.lm.n_ctx_seq:
            return 0
        common = whole_images(self._usable_prefix(shared, len(entry.tokens), entry.pos_min,
                                                  len(tokens), rollback=0), media)
        checkpoint = SlotCheckpoints(items=entry.checkpoints).latest(
            whole_images(min(shared, len(tokens) - 1), media))
        return max(common, checkpoint.n_tokens if checkpoint is not None else 0)

    def choose_slot(self, free: list[Slot], tokens: list[int],
                     media: MediaPrompt | None = None) -> Slot:
        """The free slot whose cache shares the longest prefix, unless taking it would throw
        away more than it reuses (another conversation's prompt): then an empty slot, else the
        least recently used one (whose prompt goes to the prompt cache first)."""
        kept = {slot.seq_id: self._slot_prefix(slot, tokens, media) for slot in free}
        best = max(free, key=lambda s: (kept[s.seq_id], -s.last_used))
        if kept[best.seq_id] >= len(best.tokens) - kept[best.seq_id]:
            return best
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    def keep_prefix(self, slot: Slot, tokens: list[int], media: MediaPrompt | None,
                     reuse: bool) -> Kept:
        """Make `slot` hold the longest prefix of `tokens` it may keep, from its own KV, a
        checkpoint or a saved prompt (none without `reuse`), and say so in the log."""
        restored = self._swap_in_saved_prompt(slot, tokens, media) if reuse else ""
        n, checkpoint = self._reuse_prefix(slot, tokens, media, reuse)
        source = "" if not n else restored or ("checkpoint" if checkpoint is not None
                                               else "slot")
        kept = Kept(n, source, checkpoint.n_tokens if checkpoint is not None else None)
        how = source or "nothing"
        if checkpoint is not None:
            how = f"checkpoint at {checkpoint.n_tokens}{' of a saved prompt' * bool(restored)}"
        log.info("prompt: %d tokens, %d kept (%s), %d to read", len(tokens), n, how,
                 len(tokens) - n)
        return kept

    def _swap_in_saved_prompt(self, slot: Slot, tokens: list[int],
                              media: MediaPrompt | None = None) -> str:
        """Before a request takes `slot`: save what it holds to the prompt cache when the
        request would throw most of it away, and restore a saved prompt into it when one shares
        a longer prefix with the request than the slot itself does.

        A continuation (the next turn of the conversation the slot holds) keeps most of it
        and loses only a tail, which is not worth a copy. A saved prompt is matched by its
        longest common prefix with the request, so a prompt that differs from it late (a
        changed line after the tools) still reuses everything before that line. The slot's
        checkpoints go and come back with its prompt. A long prompt looks on disk too, where
        a file reusing more than RAM holds is read and restored instead. Where the restored
        prompt came from ("prompt cache", "disk"), or "" when none was."""
        cache, disk = self.prompt_cache, self.disk
        if cache is None and disk is None:
            return ""
        kept = self._slot_prefix(slot, tokens, media)
        lost = len(slot.tokens) - kept
        if lost >= MIN_SAVED_TOKENS and lost > kept // 4:
            self.stash(slot)
        usable = lambda e, n: self._saved_prefix(e, n, tokens, media)
        entry, common = cache.best(tokens, usable) if cache is not None else (None, 0)
        source, found = "prompt cache", None
        for _ in range(3 if disk is not None and len(tokens) > disk.min_tokens else 0):
            found, n = disk.best(tokens, usable)
            if found is None or n < max(common + 1, kept + MIN_RESTORE_GAIN):
                break
            saved = disk.load(found)  # None: damaged or gone, and deleted: the next best
            if saved is not None:
                entry, common, source = saved, n, "disk"
                break
        if entry is None or common < kept + MIN_RESTORE_GAIN:
            return ""
        if self._restore(slot, entry, common):
            return source
        if source == "disk":  # its key matched and llama.cpp still said no: never again
            disk.discard(found)
        return ""

    def stash(self, slot: Slot) -> None:
        """Save what `slot` holds to the prompt cache (unless it holds it already): a request
        takes the slot for another prompt, or a fill band moved down drops the sequence."""
        cache = self.prompt_cache
        if cache is None:  # with a disk cache alone, a long prompt goes there
            if self.disk is not None and len(slot.tokens) >= self.disk.min_tokens:
                self._to_disk(self._save(slot))
            return
        if not slot.tokens or cache.covers(slot.tokens):
            return
        started = time.perf_counter()
        saved = self._save(slot, limit=cache.budget if self.disk is None else None)
        if saved is not None and not cache.put(saved):
            self._to_disk(saved)  # larger than the RAM cache's whole budget
        elif saved is not None:
            log.info("prompt cache: saved %d tokens of slot %d with %d checkpoints "
                     "(%.1f MiB) in %.0f ms; %d prompts, %.1f of %.1f MiB",
                     len(saved.tokens), slot.seq_id, len(saved.checkpoints),
                     saved.nbytes / 2**20, (time.perf_counter() - started) * 1e3,
                     len(cache), cache.used / 2**20, cache.budget / 2**20)

    def _save(self, slot: Slot, limit: int | None = None) -> SavedSequence | None:
        saved = state.save(self.model.lm.ctx, slot.seq_id, slot.tokens, limit=limit,
                           checkpoints=slot.checkpoints.copy())
        if saved is not None and self.disk is not None:
            saved.kv_key = self.disk.key()
        return saved

    def _to_disk(self, saved: SavedSequence | None) -> None:
        """A prompt the RAM cache lets go (or has no room for), to the disk cache's writer."""
        if saved is not None and self.disk is not None:
            self.disk.put(saved, saved.kv_key or self.disk.key())

    def save_all(self, slots: list[Slot], deadline: float) -> None:
        """The runner ends: every slot's prompt and every prompt the RAM cache holds, most
        recently used first, written to disk until `deadline` (time.monotonic)."""
        disk = self.disk
        if disk is None:
            return
        disk.drain(deadline)  # what was evicted before goes first: it is older
        key = disk.key()
        cached = self.prompt_cache.entries[::-1] if self.prompt_cache is not None else []
        for what in [*sorted(slots, key=lambda s: -s.last_used), *cached]:
            if time.monotonic() > deadline:
                log.info("prompt cache on disk: out of time; the rest is not written")
                return
            if isinstance(what, Slot):
                if len(what.tokens) < disk.min_tokens:
                    continue
                what = self._save(what)
                if what is None:
                    continue
            try:
                disk.write(what, what.kv_key or key)
            except OSError as e:  # a full or read-only disk: the rest would fail alike
                log.warning("prompt cache on disk: could not write: %s", e)
                return

    def _restore(self, slot: Slot, entry: SavedSequence, common: int) -> bool:
        started = time.perf_counter()
        restored = state.restore(self.model.lm.ctx, slot.seq_id, entry)
        if not restored:
            log.warning("prompt cache: llama.cpp refused a saved prompt of %d tokens",
                        len(entry.tokens))
            slot.tokens.clear()
            slot.checkpoints.clear()
        else:
            slot.tokens = list(entry.tokens)
            slot.checkpoints = SlotCheckpoints(items=entry.checkpoints)
            log.info("prompt cache: restored %d tokens into slot %d (%d reused) in %.0f ms",
                     len(entry.tokens), slot.seq_id, common,
                     (time.perf_counter() - started) * 1e3)
        if self.model.drafter is not None:  # its cache of this sequence held something else
            self.model.drafter.forget(slot.seq_id, 0)
        return restored

    def _reuse_prefix(self, slot: Slot, tokens: list[int], media: MediaPrompt | None = None,
                      reuse: bool = True) -> tuple[int, Checkpoint | None]:
        """Keep the slot's KV for the longest prefix it shares with `tokens` that the model's
        reuse rules allow (`_slot_reuse`): restore the checkpoint that reaches furthest if one
        does, then cut the KV back. Returns how many tokens are kept (none without `reuse`)
        and the checkpoint restored."""
        seq = slot.seq_id
        common, checkpoint = self._slot_reuse(slot, tokens, media) if reuse else (0, None)
        if checkpoint is not None:
            started = time.perf_counter()
            if state.load(self.model.lm.ctx, seq, checkpoint):
                log.info("checkpoint: restored slot %d at %d of %d tokens (%.1f MiB) in "
                         "%.0f ms", seq, checkpoint.n_tokens, len(slot.tokens),
                         checkpoint.nbytes / 2**20, (time.perf_counter() - started) * 1e3)
            else:  # the state may be half written: read it all again
                log.warning("checkpoint: llama.cpp refused the checkpoint at %d of slot %d",
                            checkpoint.n_tokens, seq)
                common, checkpoint = 0, None
        if common > 0 and self.model.cut(seq, common):
            del slot.tokens[common:]
        else:
            self.model.cut(seq, -1)
            slot.tokens.clear()
            common, checkpoint = 0, None
        if self.checkpoint_spacing:
            slot.checkpoints.cut(common)
        if self.model.drafter is not None:
            self.model.drafter.forget(seq, common)
        return common, checkpoint

    # ---- taking checkpoints while a prompt is read ---------------------------------------
    def checkpoint_stop(self, slot: Slot) -> int | None:
        """Where the prompt chunk being filled must end for a checkpoint to be taken there:
        the next of the prompt's END positions before its end (`_end_positions`; checkpoints
        are taken between decodes)."""
        work = slot.work
        if not self.checkpoint_spacing or work.media is not None or slot.replaying:
            return None
        n = len(slot.tokens)
        return next((p for p in self._end_positions(len(work.prompt)) if n < p), None)

    def _end_positions(self, end: int) -> list[int]:
        """Where a prompt of `end` tokens gets its END checkpoints (checkpoints.ends: a
        micro-batch and NEAR_END before its end, and the end), in order."""
        ubatch = min(self.model.plan.n_ubatch, self.model.lm.n_batch)  # as params.py sets it
        return [end - back for back in ends(ubatch) if end - back > 0]

    def checkpoint_read(self, slot: Slot) -> None:
        """After a prompt chunk was decoded: a checkpoint when the slot is at one of the
        prompt's END positions, or `checkpoint_spacing` past its latest checkpoint. Never
        during the answer: decoding an answer costs no copies."""
        work = slot.work
        if not self.checkpoint_spacing or work.media is not None:
            return
        n, end = len(slot.tokens), len(work.prompt)
        if n in self._end_positions(end):
            kind = END
        elif n - slot.checkpoints.last_at(n) >= self.checkpoint_spacing:
            kind = SPACED
        else:
            return
        started = time.perf_counter()
        checkpoint = state.take(self.model.lm.ctx, slot.seq_id, n, kind)
        if checkpoint is None:
            log.warning("checkpoint: llama.cpp gave no state for slot %d at %d", slot.seq_id, n)
            return
        slot.checkpoints.add(checkpoint)
        log.info("checkpoint: slot %d at %d (%s, %.1f MiB) in %.0f ms; %d held, %.1f MiB",
                 slot.seq_id, n, kind, checkpoint.nbytes / 2**20,
                 (time.perf_counter() - started) * 1e3, len(slot.checkpoints),
                 slot.checkpoints.nbytes / 2**20)


def whole_images(common: int, media: MediaPrompt | None) -> int:
    """A reusable prefix cut back to the start of an image it would split: an image's cells
    are kept whole or read again whole."""
    if media is not None and common > 0:
        span = media.span_at(common)
        if span is not None:
            return span.start
    return common
