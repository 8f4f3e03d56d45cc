"""One decode step of the runner's engine: a `llama_decode` whose batch carries the next token
of every slot that is answering (with its drafts, to be checked) plus a chunk of any prompt
being read, then sampling for the slots whose logits came out.

On a GPU `llama_decode` returns before the device finishes; the text of the previous step's
tokens (detokenizing, stop strings, sending) is handled then, while the device works, and only
sampling waits for it. One object the runner's RunnerEngine (engine.py) holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from localllm.engine.drafters import MTPDrafter, Want
from localllm.engine.loaded import LoadedModel
from localllm.engine.vision import is_image_token
from localllm.planner.plan import Plan

from localllm.speculative import mode as mode_row

from .protocol import Progress, Threads
from .replies import Replies
from .reuse import PromptReuse
from .slots import Room, Slot, Work
from .speculation import StepCosts
from .threads import ThreadGovernor

log = logging.getLogger("localllm.runner")
Row = tuple[Slot, int, int]  # (slot, tokens it put in the batch, row whose logits to sample)


class Steps:
    def __init__(self, model: LoadedModel, slots: list[Slot], room: Room, replies: Replies,
                 reuse: PromptReuse, step_costs: StepCosts):
        self.model = model
        self.slots = slots
        self.room = room
        self.replies = replies
        self.reuse = reuse
        self.step_costs = step_costs
        self.tokens_generated = 0  # over the runner's life, for its log
        self.on_threads: Callable[[Threads], None] | None = None
        # The loaded plan's pace (engine.RunnerEngine.pace): prompt tokens per step, decode threads
        self.plan: Plan | None = None
        self.prompt_chunk = 0
        self.threads: ThreadGovernor | None = None
        self.n_threads = 0
        self.cpu_share = 1  # runners of the daemon computing on the CPU at once, this one too

    def step(self) -> None:
        """One llama_decode over every busy slot, then sampling for those that answer."""
        self._read_images()
        rows = self._fill_batch()
        if not rows:
            return
        started = time.perf_counter_ns()
        n_tokens = self.model.batch.n_tokens
        code = self.model.decode()
        if code != 0:
            self.replies.fail([slot for slot, _, _ in rows], code)
            return
        for slot, n, _ in rows:  # the batch is in the KV cache now
            if slot.unread and not slot.replaying and slot.work.request.prompt_logprobs:
                self.replies.score_prompt(slot, n)
            added, slot.to_decode = slot.to_decode[:n], slot.to_decode[n:]
            slot.tokens.extend(added)
            if slot.replaying:  # KV read again after a band switch: not the request's prompt
                slot.replaying -= n
                slot.unread -= n
            elif slot.unread:
                slot.unread -= n
                self.reuse.checkpoint_read(slot)
                if slot.unread:
                    slot.work.emit(Progress(len(slot.tokens), len(slot.work.prompt),
                                            prompt_cached=slot.work.cached))
                else:  # after the prompt's checkpoints: their copies are not decode time
                    slot.work.prompt_done_ns = time.perf_counter_ns()
        for slot, _, _ in rows:
            if slot.fresh is not None:  # text of last step's token, while the device works
                token, slot.fresh = slot.fresh, None
                self.replies.text(slot, token)
        for slot, _, logits_row in rows:
            if slot.work is not None and logits_row >= 0:  # (a stop string may have ended it)
                if slot.work.limit == 0:  # the prompt only (echo with max_tokens 0)
                    self.replies.finish(slot, "length")
                elif slot.drafts:
                    self._verify(slot, logits_row)
                else:
                    self._sample(slot, logits_row)
        if all(not slot.unread for slot, _, _ in rows):  # answering only: what drafts cost
            seconds = (time.perf_counter_ns() - started) / 1e9
            self.step_costs.record(n_tokens, seconds)
            if self.threads is not None and self.cpu_share == 1:  # (sharing: others are ours)
                self._adapt_threads(seconds, max(len(slot.tokens) for slot, _, _ in rows))
        if isinstance(self.model.drafter, MTPDrafter):
            self._feed_mtp(rows, n_tokens)
        self._prepare_drafts()

    def _adapt_threads(self, step_seconds: float, depth: int) -> None:
        change = self.threads.observe(step_seconds, depth)
        if change is None:
            return
        self.set_threads()
        log.info("threads: %s", change.reason)
        if self.on_threads is not None and not change.trial:  # ps shows what is kept
            self.on_threads(Threads(change.n_threads, change.reason))

    def share_cpu(self, runners: int) -> Threads:
        """Threads for `runners` runners of the daemon computing on the CPU at once, this one
        among them: each takes its plan's share. Two runners at the plan's full count each
        meet at llama.cpp's barriers on cores the other holds: on 2 cores, a one-token answer
        of a small model took 0.67 s beside another model's prompt, 0.05 s alone."""
        self.cpu_share = max(1, runners)
        self.set_threads()
        decode, prompt = self.model.threads()  # what llama.cpp holds now
        if self.cpu_share == 1:
            reason = f"alone on the CPU again: {decode} threads, {prompt} for prompts"
        else:
            reason = (f"{self.cpu_share} models compute on the CPU at once: {decode} of the "
                      f"plan's {self.plan.n_threads} threads, {prompt} of "
                      f"{self.plan.n_threads_batch} for prompts")
        log.info("threads: %s", reason)
        return Threads(decode, reason)

    def set_threads(self) -> None:
        """The decode and prompt threads: the plan's, less what the governor took away while
        other processes held cores, within this runner's share of the CPU."""
        share = self.cpu_share
        governed = self.threads.n_threads if self.threads is not None else self.plan.n_threads
        n = max(1, min(governed, self.plan.n_threads // share))
        batch = max(1, self.plan.n_threads_batch // share)
        if governed < self.plan.n_threads:
            batch = min(batch, n)
        self.n_threads = n
        self.model.set_threads(n, batch)

    def _feed_mtp(self, rows: list[Row], n_tokens: int) -> None:
        """Tell the MTP drafter what this step committed, with the target's hidden states."""
        drafter = self.model.drafter
        drafter.start_step(n_tokens)
        for slot, _, _ in rows:
            answering = slot.work is not None and not slot.unread and slot.to_decode
            drafter.observe(slot.seq_id, slot.first_pos, slot.tokens[slot.first_pos:],
                            slot.batch_row, slot.to_decode[0] if answering else None)

    def _prepare_drafts(self) -> None:
        """The drafts each answering slot's next step checks (slot.drafts)."""
        wants = []
        for slot in self.slots:
            slot.drafts = []
            work = slot.work
            if work is None or work.drafting is None or slot.unread or not slot.to_decode:
                continue
            room = min(self.room.seq - len(slot.tokens) - 2,
                       work.limit - len(work.answer) - 1)
            if not mode_row(work.drafting.mode).loaded:  # drafts from the text (lookup)
                slot.drafts = work.drafting.propose_lookup(work.history, room)
                continue
            n = work.drafting.wanted(room)
            if n > 0:
                wants.append(Want(slot.seq_id, slot.tokens, slot.to_decode[0], n))
        drafter = self.model.drafter
        if drafter is None or (not wants and not isinstance(drafter, MTPDrafter)):
            return
        started = time.perf_counter()
        drafts = drafter.draft(wants)  # MTP: also feeds its cache, drafts or not
        if drafts:
            self.step_costs.record_drafting(sum(len(d) for d in drafts.values()),
                                            time.perf_counter() - started)
        for slot in self.slots:
            slot.drafts = drafts.get(slot.seq_id, slot.drafts)

    def _read_images(self) -> None:
        """Each slot whose prompt goes on with an image reads that one image: encoded by the
        projector, its embeddings decoded into the slot's sequence (its own llama_decode: a
        batch holds tokens or embeddings, not both)."""
        for slot in self.slots:
            work = slot.work
            if not slot.reading_prompt or work.media is None or \
                    not is_image_token(slot.to_decode[0]):
                continue
            if work.cancelled.is_set():
                continue  # the loop's cancel check ends it before the next image
            pos = len(slot.tokens)
            span = work.media.spans[pos]
            try:
                self.model.vision.read_image(self.model.lm.ctx, span, pos, slot.seq_id,
                                             self.model.lm.n_batch)
            except RuntimeError as e:
                log.error("request %s: %s", work.request.id, e)
                self.replies.fail([slot], str(e))
                continue
            slot.tokens.extend(slot.to_decode[:span.n_tokens])
            del slot.to_decode[:span.n_tokens]
            slot.unread -= span.n_tokens
            work.emit(Progress(len(slot.tokens), len(work.prompt), prompt_cached=work.cached))

    def _fill_batch(self) -> list[Row]:
        """Put every answering slot's next token, then prompt chunks, into the batch."""
        put = self.model.put
        n_batch = self.model.lm.n_batch
        rows: list[Row] = []
        n = 0
        answering = [s for s in self.slots if s.work is not None and not s.unread
                     and s.to_decode]
        reading = sorted((s for s in self.slots if s.reading_prompt),
                         key=lambda s: s.work.started_ns)
        for slot in answering:
            if len(slot.tokens) + len(slot.to_decode) > self.room.seq:
                self.replies.finish(slot, "length")  # context full
                continue
            if slot.drafts:
                slot.drafts = slot.drafts[:max(0, n_batch - n - 1)]
                slot.to_decode = slot.to_decode[:1] + slot.drafts
            slot.first_pos, slot.batch_row = len(slot.tokens), n
            for i, token in enumerate(slot.to_decode):
                n = put(n, token, len(slot.tokens) + i, slot.seq_id, True)
            rows.append((slot, len(slot.to_decode), slot.batch_row))
        budget = min(n_batch, self.prompt_chunk) - n
        logit_room = self.model.lm.n_logit_rows - n  # every row above asked for logits
        for slot in reading:
            if budget <= 0:
                break
            text = slot.unread if slot.work.media is None else _text_run(slot.to_decode,
                                                                          slot.unread)
            take = min(slot.unread, budget, text)
            if take == 0:
                continue  # an image comes next: _read_images reads it before the next step
            if slot.replaying:  # a chunk replays KV or reads the prompt, never both
                take = min(take, slot.replaying)
            stop = self.reuse.checkpoint_stop(slot)
            if stop is not None:
                take = min(take, stop - len(slot.tokens))
            every = slot.work.request.prompt_logprobs and not slot.replaying  # every row's
            if every:  # the context holds the logits of n_logit_rows rows a decode
                take = min(take, logit_room)
                if take == 0:
                    continue
            last = take == slot.unread and not slot.replaying
            logit_room -= take if every else int(last)
            slot.first_pos, slot.batch_row = len(slot.tokens), n
            for i in range(take):
                n = put(n, slot.to_decode[i], len(slot.tokens) + i, slot.seq_id,
                        every or (last and i == take - 1))
            rows.append((slot, take, n - 1 if last else -1))
            budget -= take
        self.model.batch.n_tokens = n
        return rows

    def _sample(self, slot: Slot, row: int) -> None:
        work = slot.work
        token = work.sampler.sample(self.model.lm.ctx, row)
        if self.model.tokenizer.is_eog(token):
            self.replies.finish(slot, "stop")
            return
        self._append(work, row, token)
        slot.to_decode = [token]
        if len(work.answer) >= work.limit or len(slot.tokens) + 1 >= self.room.n_ctx:
            self.replies.text(slot, token)
            if slot.work is not None:
                self.replies.finish(slot, "length")
            return
        slot.fresh = token

    def _append(self, work: Work, row: int, token: int) -> None:
        work.answer.append(token)
        if work.drafting is not None:
            work.history.append(token)
        self.tokens_generated += 1
        if work.request.logprobs is not None:
            work.pending_logprobs.append(self.replies.logprob_entry(work, row, token))

    def _verify(self, slot: Slot, row: int) -> None:
        """Check the drafts decoded after the slot's last token: sample each position with the
        request's sampler and keep drafts while they equal the sample; the first sample that
        differs (or the one after the last draft) is the next token. Cells of rejected drafts
        leave the KV cache."""
        work, drafts = slot.work, slot.drafts
        slot.drafts = []
        keep = len(slot.tokens) - len(drafts)  # the KV that stays: up to the slot's last token
        work.drafted += len(drafts)
        accepted = 0
        for i in range(len(drafts) + 1):
            token = work.sampler.sample(self.model.lm.ctx, row + i)
            if self.model.tokenizer.is_eog(token):
                self._trim(slot, keep)
                self.replies.finish(slot, "stop")
                break
            self._append(work, row + i, token)
            if i < len(drafts) and token == drafts[i]:
                accepted += 1
                work.draft_accepted += 1
                keep += 1  # already in the cache
                self.replies.text(slot, token)
                if slot.work is not None and len(work.answer) >= work.limit:
                    self._trim(slot, keep)
                    self.replies.finish(slot, "length")
                if slot.work is None:
                    self._trim(slot, keep)
                    break
                continue
            self._trim(slot, keep)
            slot.to_decode = [token]
            self.replies.text(slot, token)
            if slot.work is not None and (len(work.answer) >= work.limit
                                          or keep + 1 >= self.room.n_ctx):
                self.replies.finish(slot, "length")
            break
        if drafts:
            work.drafting.record(len(drafts), accepted)

    def _trim(self, slot: Slot, keep: int) -> None:
        """Drop the slot's KV cells from position `keep` on (rejected or unused drafts)."""
        if len(slot.tokens) > keep:
            if not self.model.cut(slot.seq_id, keep):
                raise RuntimeError("llama.cpp could not take back rejected drafts")
            del slot.tokens[keep:]


def _text_run(tokens: list[int], limit: int) -> int:
    """How many of the first `limit` tokens come before the first image placeholder."""
    for i in range(limit):
        if is_image_token(tokens[i]):
            return i
    return limit
