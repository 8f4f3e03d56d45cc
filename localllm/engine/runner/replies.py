"""What a slot's request hears: answer tokens turned into text (UTF-8 pieces joined, stop
strings held back), Token events with the request's running totals and logprobs, the one Done
that ends it, or a Failure when llama.cpp refused a step.

One object the runner's RunnerEngine (engine.py) holds; the decode step (step.py) calls it for each
token it keeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from localllm.engine.loaded import LoadedModel, log_probs
from localllm.engine.vision import text_tokens
from localllm.repeats import LoopGuard

from .protocol import Done, ExpertCacheStats, Failure, Token
from .slots import Room, Slot, Work

log = logging.getLogger("localllm.runner")


class Replies:
    def __init__(self, model: LoadedModel, room: Room):
        self.model = model
        self.room = room
        # The expert cache's figures after each answer, before its Done, so that /api/stats
        # has them when the answer ends (a cheap ctypes call; nothing without a pool)
        self.on_expert_cache: Callable[[ExpertCacheStats], None] | None = None

    def text(self, slot: Slot, token: int) -> None:
        """Decode one answer token into text; hold back what may start a stop string."""
        work = slot.work
        work.pending_tokens += 1
        # special=True: control tokens the chat layer parses (<think>, gpt-oss's <|channel|>)
        # must reach it as text; end-of-generation tokens never get here.
        text = work.decoder.decode(self.model.tokenizer.token_bytes(token, special=True))
        text, hit = work.stops.feed(text)
        if text:
            work.emit(self._token_event(slot, text))
        if hit:
            self.finish(slot, "stop", stop_hit=True)
        elif work.loops is not None and (period := work.loops.feed(text)):
            log.info("request %s stopped after %d answer tokens: %s", work.request.id,
                     len(work.answer), LoopGuard.note(period))
            self.finish(slot, "loop", stop_hit=True)  # as a stop: the rest is more of the loop

    def _token_event(self, slot: Slot, text: str) -> Token:
        work = slot.work
        logprobs = None
        if work.request.logprobs is not None:
            logprobs, work.pending_logprobs = tuple(work.pending_logprobs), []
        event = Token(text, work.pending_tokens, eval_count=len(work.answer),
                      eval_duration_ns=work.eval_ns,
                      prompt_eval_count=len(work.prompt) - work.cached,
                      prompt_eval_duration_ns=work.prompt_ns,
                      context_used=len(work.prompt) + len(work.answer),
                      drafted=work.drafted, draft_accepted=work.draft_accepted,
                      logprobs=logprobs)
        work.pending_tokens = 0
        return event

    def finish(self, slot: Slot, reason: str, stop_hit: bool = False) -> None:
        """End the slot's request: its held-back text, then Done; the slot keeps its KV."""
        work = slot.work
        if slot.fresh is not None and not stop_hit:
            token, slot.fresh = slot.fresh, None
            self.text(slot, token)
            if slot.work is None:
                return  # that token completed a stop string
        slot.fresh = None
        if not stop_hit:
            tail = work.stops.flush() + work.decoder.decode(b"", final=True)
            if tail or work.pending_tokens:
                work.emit(self._token_event(slot, tail))
        eval_ns = work.eval_ns
        self.report_expert_cache()
        if reason == "cancelled":  # logged before the Done: whoever sees it sees the line
            log.info("request %s cancelled after %d answer tokens, %d of %d prompt tokens "
                     "read", work.request.id, len(work.answer),
                     min(len(slot.tokens), len(work.prompt)), len(work.prompt))
        work.emit(Done(
            done_reason=reason,
            prompt_eval_count=len(work.prompt) - work.cached,
            prompt_eval_duration_ns=work.prompt_ns,
            eval_count=len(work.answer),
            eval_duration_ns=eval_ns,
            prompt_tokens=len(work.prompt),
            cached_tokens=work.cached,
            cached_from=work.cached_from,
            checkpoint=work.checkpoint,
            prompt_truncated=work.truncated,
            context_used=len(slot.tokens),
            n_ctx=self.room.n_ctx,
            context=tuple(text_tokens(work.prompt) if work.media else work.prompt)
            + tuple(work.answer),
            drafted=work.drafted,
            draft_accepted=work.draft_accepted,
            stop_sequence=work.stops.hit if stop_hit else None,
            prompt_logprobs=tuple(work.prompt_logprobs) if work.request.prompt_logprobs
            else None,
        ))
        work.sampler.free()
        if work.media is not None:
            work.media.free()
        slot.work = None
        slot.to_decode = []
        slot.unread = slot.replaying = 0
        slot.drafts = []
        slot.last_used = time.monotonic()

    def report_expert_cache(self) -> None:
        if self.on_expert_cache is None:
            return
        figures = self.model.expert_cache_stats()
        if figures is not None:
            self.on_expert_cache(figures)

    def fail(self, slots: list[Slot], code: int | str) -> None:
        """llama_decode refused the batch: fail the requests in it and forget their caches."""
        why = code if isinstance(code, str) else {
            1: "no room left in the KV cache", 2: "aborted"}.get(code, f"error {code}")
        for slot in slots:
            work = slot.work
            if work is not None:
                work.sampler.free()
                if work.media is not None:
                    work.media.free()
                work.emit(Failure(f"llama_decode failed: {why}"))
            slot.work, slot.fresh, slot.to_decode, slot.unread = None, None, [], 0
            slot.replaying = 0
            self.model.cut(slot.seq_id, -1)
            slot.tokens.clear()
            slot.checkpoints.clear()
            slot.drafts = []
            if self.model.drafter is not None:
                self.model.drafter.forget(slot.seq_id, 0)

    def score_prompt(self, slot: Slot, n: int) -> None:
        """The logprobs of the prompt tokens that follow this step's `n` prompt rows (row i's
        logits predict the token after it; the last prompt row's predict the answer)."""
        work = slot.work
        start = len(slot.tokens)
        for i in range(n):
            following = start + i + 1
            if following < len(work.prompt):
                work.prompt_logprobs.append(
                    self.logprob_entry(work, slot.batch_row + i, work.prompt[following]))

    def logprob_entry(self, work: Work, row: int, token: int) -> dict:
        logits = work.sampler.logits(self.model.lm.ctx, row)
        chosen, top = log_probs(logits, token, work.request.logprobs or 0)
        return {**self._entry(token, chosen),
                "top_logprobs": [self._entry(t, lp) for t, lp in top]}

    def first_prompt_entry(self, work: Work) -> None:
        """The prompt's first token, with logprob None (nothing comes before it); `added`
        marks a BOS the tokenizer put in front of the text."""
        tokenizer, first = self.model.tokenizer, work.prompt[0]
        added = (first == tokenizer.bos and tokenizer.add_bos
                 and not work.request.prompt.startswith(tokenizer.bos_piece))
        work.prompt_logprobs.append({**self._entry(first, None), "top_logprobs": [],
                                     "added": added})

    def _entry(self, token: int, logprob: float | None) -> dict:
        raw = self.model.tokenizer.token_bytes(token, special=True)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(raw)}
