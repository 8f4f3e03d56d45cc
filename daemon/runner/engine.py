"""The runner's engine: one llama.cpp context, `n_parallel` slots, one loop that drives them all.

Runs inside the runner process only (see __main__.py): a crash in here takes down that process,
never the daemon.

Each step is one `llama_decode` whose batch carries the next token of every slot that is
answering plus a chunk of any prompt being read (continuous batching: a new request joins at
the next step). Prompts are read in chunks of at most `n_batch` tokens, whole micro-batches on
a GPU (see prompt_chunk), so a cancel or a new request never waits for a whole long prompt.
On a GPU `llama_decode` returns before the device finishes; the text of the previous step's
tokens (detokenizing, stop strings, sending) is handled then, while the device works, and only
sampling waits for it.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import llama_cpp
from localllm.llama.params import MAX_DRAFT, draft_ceiling
from localllm.options import SPECULATIVE_MODES
from localllm.profiles.plan import Plan

from . import checkpoints
from . import model as llama
from .drafters import DraftModel, MTPDrafter, Want
from .protocol import (
    Band,
    Done,
    EmbedRequest,
    Embeddings,
    Event,
    Failure,
    GenerationRequest,
    Progress,
    Threads,
    Token,
    TokenCount,
    TokenizeRequest,
)
from .bands import FillBands
from .reuse import PromptReuse
from .sampling import RequestError, Sampler, log_probs
from .seqstate import PromptCache
from .slots import Slot, Work
from .speculation import Drafting, StepCosts
from .threads import ThreadGovernor
from .vision import MediaPrompt, Vision, is_image_token, text_tokens

log = logging.getLogger("localllm.runner")
STEP_TARGET_S = 0.25
CANCEL_BOUND_S = 1.0  # the longest a cancel or a new request waits behind a prompt's step
MIN_PROMPT_CHUNK = 32

@dataclass
class Submission:
    request: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: threading.Event


@dataclass
class Question:
    """A request with one answer, served between two decode steps: a token count or
    embeddings (llama.cpp contexts are driven from the engine's thread only)."""
    answer: Callable[[], Event]
    emit: Callable[[Event], None]


class Engine(PromptReuse, FillBands):
    def __init__(self, model_path: str, plan: Plan, draft_model_path: str | None = None,
                 adapt_threads: bool = True, projector_path: str | None = None,
                 prompt_cache_bytes: int = 0, bands: tuple[Plan, ...] = (),
                 start_band: int = 0):
        """`bands`: plans for smaller contexts than `plan`'s, smallest first (fill bands: less
        KV leaves VRAM for more of the weights). The engine starts in `start_band` and moves
        up when a sequence needs more room (_follow_bands); `plan` is the last band."""
        if projector_path:
            plan = with_room_for_images(plan, projector_path)
        if bands and (projector_path or known_mode(plan.speculative) in ("mtp", "draft")):
            log.info("fill bands off: a projector or a draft model is bound to the loaded "
                     "model (the daemon does not send bands then)")
            bands = ()
        self.model_path = model_path
        self.plans = (*bands, plan)  # one per fill band; the last holds the whole context
        self.band = max(0, min(start_band, len(self.plans) - 1))
        self.band_pauses: list[float] = []
        self.adapt_threads = adapt_threads
        plan = self.plans[self.band]
        self.plan = plan
        self.speculative = known_mode(plan.speculative)
        # The longest draft. The plan's draft_n_max bounds what costs memory: recurrent-state
        # snapshots (llama.cpp keeps one per position a rejected draft may take back, plus one
        # for the MTP prefix rule) and MTP's chained passes, whose acceptance falls fast after a
        # few. Prompt lookup and a draft model on an attention model cost nothing to allow
        # longer: the per-request length adapts to the acceptance measured (the plan chose its
        # length for an assumed one).
        planned = draft_ceiling(plan)
        self.lm = llama.load(model_path, plan)
        self.draft_cap = planned if self.speculative == "mtp" or self.lm.recurrent \
            else MAX_DRAFT
        self.tokenizer = llama.Tokenizer(self.lm.model, self.lm.vocab)
        # What one request may use (the last band's context) and what the loaded band holds.
        self.room = self.lm.n_ctx_seq
        self.n_ctx = self.room if self.band == len(self.plans) - 1 else self.plans[-1].n_ctx
        self.slots = [Slot(i) for i in range(self.lm.n_seq)]
        self.batch_capacity = llama.batch_capacity(self.lm)
        self.batch = llama_cpp.llama_batch_init(self.batch_capacity, 0, 1)
        self.drafter: MTPDrafter | DraftModel | None = None
        if self.speculative == "mtp":
            self.drafter = MTPDrafter(self.lm, plan, self.batch_capacity)
        elif self.speculative == "draft":
            if not draft_model_path:
                raise llama.ModelLoadError("the plan drafts with a draft model but none was "
                                           "given (pair one: options.draft_model or the "
                                           "catalog's draft)")
            self.drafter = DraftModel(draft_model_path, self.lm, plan, self.batch_capacity)
        self.inbox: queue.Queue[Submission | None] = queue.Queue()
        self.backlog: collections.deque[Submission] = collections.deque()
        self.tokens_generated = 0  # over the runner's life, for its log
        self._closing = False
        self._embedder = None
        self.step_costs = StepCosts(per_token_prior=0.1 if plan.n_gpu_layers > 0 else 0.6)
        # Prompts of slots taken for other requests, in RAM (seqstate.py). Not with MTP: its
        # own cache of each sequence would have to be saved and restored beside the target's.
        self.prompt_cache: PromptCache | None = None
        # Tokens between checkpoints of a long prompt; 0: a model of full attention only, whose
        # KV is cut back anywhere, needs none (checkpoints.py)
        self.checkpoint_spacing = checkpoints.spacing(self.n_ctx) \
            if self.lm.recurrent or self.lm.n_swa else 0
        if prompt_cache_bytes > 0 and self.speculative != "mtp":
            self.prompt_cache = PromptCache(
                prompt_cache_bytes, keep_contained=bool(self.lm.n_swa or self.lm.recurrent))
        # Fewer decode threads while other processes hold cores (threads.py); each change
        # goes to `on_threads` (the runner tells the daemon, which shows it in ps).
        self._pace(plan)
        self.on_threads: Callable[[Threads], None] | None = None
        self.on_band: Callable[[Band], None] | None = None  # after each band switch
        self.vision: Vision | None = None
        if projector_path:
            try:
                self.vision = Vision(projector_path, self.lm.model,
                                     use_gpu=plan.n_gpu_layers > 0 and plan.projector_on_gpu,
                                     n_threads=plan.n_threads_batch, flash_attn=plan.flash_attn)
            except ValueError as e:
                raise llama.ModelLoadError(str(e)) from None

    def _pace(self, plan: Plan) -> None:
        """Prompt chunks and decode threads for the plan loaded (at start, after a band switch)."""
        self._prompt_chunk = prompt_chunk(plan, self.lm.n_batch)
        self.threads = ThreadGovernor(plan.n_threads, plan.predicted_decode_tps,
                                      plan.predicted_decode_by_depth) \
            if self.adapt_threads else None
        self.n_threads = plan.n_threads

    # ---- requests in ---------------------------------------------------------------------
    def submit(self, request: GenerationRequest, emit: Callable[[Event], None],
               cancelled: threading.Event) -> None:
        """Thread-safe: queue a request for the loop."""
        self.inbox.put(Submission(request, emit, cancelled))

    def ask(self, answer: Callable[[], Event], emit: Callable[[Event], None]) -> None:
        """Thread-safe: compute `answer()` in the loop's thread and emit it."""
        self.inbox.put(Question(answer, emit))

    def close(self) -> None:
        """Thread-safe: finish what is in flight, then leave `run`."""
        self.inbox.put(None)

    def tokenize(self, request: TokenizeRequest) -> TokenCount:
        if request.texts is not None:
            return self.count_tokens_each(list(request.texts))
        return self.count_tokens(request.text)

    def count_tokens(self, text: str) -> TokenCount:
        return TokenCount(len(self.tokenizer.tokenize(text)))

    def count_tokens_each(self, texts: list[str]) -> TokenCount:
        counts = tuple(len(self.tokenizer.tokenize(t, add_bos=False)) for t in texts)
        return TokenCount(sum(counts), counts)

    def embed(self, request: EmbedRequest) -> Embeddings:
        """Embeddings in a context of their own, made on first use (see embedding.py)."""
        if self._embedder is None:
            from .embedding import Embedder

            arch = self.tokenizer.metadata("general.architecture") or ""
            pooling = self.tokenizer.metadata(f"{arch}.pooling_type")
            self._embedder = Embedder(self.lm.model, self.n_ctx, self.plan.n_threads,
                                      self.plan.n_threads_batch,
                                      int(pooling) if pooling is not None else None)
        return self._embedder.embed(request)

    def _take_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if item is None:
                self._closing = True
            elif isinstance(item, Question):
                self._answer(item)
            else:
                self.backlog.append(item)

    def _answer(self, question: Question) -> None:
        from .embedding import EmbedInputError

        try:
            event = question.answer()
        except (EmbedInputError, ValueError) as e:  # too long, or a reranker asked to embed
            event = Failure(str(e), status=400)
        except Exception as e:  # a llama.cpp error ends this request, not the runner
            log.exception("request failed")
            event = Failure(f"{type(e).__name__}: {e}")
        question.emit(event)

    def _admit(self) -> None:
        """Move waiting requests into free slots (first come, first served)."""
        while self.backlog:
            free = [slot for slot in self.slots if slot.free]
            if not free:
                return
            sub = self.backlog.popleft()
            if sub.cancelled.is_set():
                sub.emit(Done("cancelled", 0, 0, 0, 0, 0, 0, 0, self.n_ctx))
                continue
            try:
                self._start(sub, free)
            except RequestError as e:
                sub.emit(Failure(str(e), status=400))
            except Exception as e:  # this request fails, not the runner
                log.exception("request %s could not start", sub.request.id)
                sub.emit(Failure(f"{type(e).__name__}: {e}"))

    def _start(self, sub: Submission, free: list[Slot]) -> None:
        request = sub.request
        media = self._tokenize_media(request) if request.images else None
        try:
            tokens = media.tokens if media else self.tokenizer.tokenize(request.prompt)
            self._check_prompt(tokens, media)
            slot = self._choose_slot(free, tokens, media)
            # scoring the prompt reads all of it
            kept = self._keep_prefix(slot, tokens, media, reuse=not request.prompt_logprobs)
            options = request.options
            sampler = Sampler(self.lm.vocab, self.lm.n_vocab, options, request.grammar,
                              text_tokens(tokens) if media else tokens, self.n_ctx)
        except BaseException:
            if media is not None:
                media.free()
            raise
        limit = options.num_predict if options.num_predict >= 0 else self.n_ctx
        cached = kept.tokens
        slot.work = Work(request=request, emit=sub.emit, cancelled=sub.cancelled,
                         prompt=tokens, sampler=sampler, limit=limit, cached=cached,
                         cached_from=kept.source, checkpoint=kept.checkpoint)
        slot.work.media = media
        # Drafters read token ids: a prompt with image placeholders is answered without them.
        mode = None if media else self._drafting_mode(request)
        if mode is not None:
            work = slot.work
            work.drafting = Drafting(self.step_costs, mode, max_length=self.draft_cap)
            work.history = list(tokens)
            work.drafted, work.draft_accepted = 0, 0
        slot.to_decode = tokens[cached:]
        slot.unread = len(slot.to_decode)
        if request.prompt_logprobs:  # the first token has no logprob: nothing comes before it
            added = (tokens[0] == self.tokenizer.bos and self.tokenizer.add_bos
                     and not request.prompt.startswith(self.tokenizer.bos_piece))
            raw = self.tokenizer.token_bytes(tokens[0], special=True)
            slot.work.prompt_logprobs.append({
                "token": raw.decode("utf-8", errors="replace"), "logprob": None,
                "bytes": list(raw), "top_logprobs": [], "added": added})

    def _tokenize_media(self, request: GenerationRequest) -> MediaPrompt:
        if self.vision is None:
            raise RequestError("this model does not support images (it was loaded without a "
                               "vision projector)")
        add_bos = self.tokenizer.add_bos and not (
            self.tokenizer.bos_piece and request.prompt.startswith(self.tokenizer.bos_piece))
        return self.vision.tokenize(request.prompt, request.images, add_bos)

    def _check_prompt(self, tokens: list[int], media: MediaPrompt | None) -> None:
        if not tokens:
            raise RequestError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            images = ""
            if media is not None:
                images = (f" ({media.image_tokens} of them for {len(media.spans)} "
                          f"image{'s' if len(media.spans) != 1 else ''})")
            trained = llama_cpp.llama_model_n_ctx_train(self.lm.model)
            bigger = (f"load the model with a larger num_ctx (it was trained on {trained} "
                      f"tokens)" if trained > self.n_ctx else
                      f"use a model with a longer context ({self.n_ctx} tokens is all this "
                      f"one was trained on)")
            raise RequestError(
                f"the prompt is {len(tokens)} tokens{images} but the loaded context holds "
                f"{self.n_ctx}; shorten it{', send fewer images' if images else ''} or "
                f"{bigger}")
        if is_image_token(tokens[-1]):
            raise RequestError("the prompt ends with an image: put text after it")

    def _drafting_mode(self, request: GenerationRequest) -> str | None:
        """Where this request's drafts come from (`options.speculative`; `auto` is the plan's
        choice), or None. MTP and a draft model must have been loaded with the model (the
        daemon reloads it when a request asks for them); a recurrent state can take drafts
        back only when the plan drafts (llama.cpp then keeps snapshots of it)."""
        mode = request.options.speculative
        if mode == "auto":
            mode = self.speculative
        if mode == "off":
            return None
        if mode in ("mtp", "draft") and (self.drafter is None or self.drafter.kind != mode):
            raise RequestError(f"speculative '{mode}': the model was loaded without "
                               f"{'its MTP layers' if mode == 'mtp' else 'a draft model'}")
        if self.lm.recurrent and self.lm.n_rollback < self.draft_cap:
            return None
        return mode

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until `close()` and nothing is left in flight."""
        while True:
            busy = any(not slot.free for slot in self.slots)
            self._take_inbox(block=not busy and not self.backlog and not self._closing)
            self._admit()
            self._drop_cancelled()
            if self._closing and not self.backlog and all(s.free for s in self.slots):
                return
            try:
                self.step()
            except Exception as e:  # a failed step ends the requests in it, not the runner
                log.exception("decode step failed")
                self._fail_batch([(s, 0, -1) for s in self.slots if not s.free],
                                 f"{type(e).__name__}: {e}")

    def _drop_cancelled(self) -> None:
        for slot in self.slots:
            if slot.work is not None and slot.work.cancelled.is_set():
                self._finish(slot, "cancelled")

    def step(self) -> None:
        """One llama_decode over every busy slot, then sampling for those that answer."""
        self._follow_bands()
        self._read_images()
        rows = self._fill_batch()
        if not rows:
            return
        started = time.perf_counter_ns()
        n_tokens = self.batch.n_tokens
        code = llama_cpp.llama_decode(self.lm.ctx, self.batch)
        if code != 0:
            self._fail_batch(rows, code)
            return
        now = time.perf_counter_ns()
        for slot, n, _ in rows:  # the batch is in the KV cache now
            if slot.unread and not slot.replaying and slot.work.request.prompt_logprobs:
                self._score_prompt(slot, n)
            added, slot.to_decode = slot.to_decode[:n], slot.to_decode[n:]
            slot.tokens.extend(added)
            if slot.replaying:  # KV read again after a band switch: not the request's prompt
                slot.replaying -= n
                slot.unread -= n
            elif slot.unread:
                slot.unread -= n
                self._checkpoint_read(slot)
                if slot.unread:
                    slot.work.emit(Progress(len(slot.tokens), len(slot.work.prompt),
                                            prompt_cached=slot.work.cached))
                else:
                    slot.work.prompt_done_ns = now
        for slot, _, _ in rows:
            if slot.fresh is not None:  # text of last step's token, while the device works
                token, slot.fresh = slot.fresh, None
                self._emit_text(slot, token)
        for slot, _, logits_row in rows:
            if slot.work is not None and logits_row >= 0:  # (a stop string may have ended it)
                if slot.work.limit == 0:  # the prompt only (echo with max_tokens 0)
                    self._finish(slot, "length")
                elif slot.drafts:
                    self._verify(slot, logits_row)
                else:
                    self._sample(slot, logits_row)
        if all(not slot.unread for slot, _, _ in rows):  # answering only: what drafts cost
            seconds = (time.perf_counter_ns() - started) / 1e9
            self.step_costs.record(n_tokens, seconds)
            if self.threads is not None:
                self._adapt_threads(seconds, max(len(slot.tokens) for slot, _, _ in rows))
        if isinstance(self.drafter, MTPDrafter):
            self._feed_mtp(rows, n_tokens)
        self._prepare_drafts()

    def _adapt_threads(self, step_seconds: float, depth: int) -> None:
        change = self.threads.observe(step_seconds, depth)
        if change is None:
            return
        self.n_threads = change.n_threads
        llama_cpp.llama_set_n_threads(self.lm.ctx, change.n_threads,
                                      min(self.plan.n_threads_batch, change.n_threads))
        log.info("threads: %s", change.reason)
        if self.on_threads is not None and not change.trial:  # ps shows what is kept
            self.on_threads(Threads(change.n_threads, change.reason))

    def _feed_mtp(self, rows: list[tuple[Slot, int, int]], n_tokens: int) -> None:
        """Tell the MTP drafter what this step committed, with the target's hidden states."""
        self.drafter.start_step(n_tokens)
        for slot, _, _ in rows:
            answering = slot.work is not None and not slot.unread and slot.to_decode
            self.drafter.observe(slot.seq_id, slot.first_pos, slot.tokens[slot.first_pos:],
                                 slot.batch_row, slot.to_decode[0] if answering else None)

    def _prepare_drafts(self) -> None:
        """The drafts each answering slot's next step checks (slot.drafts)."""
        wants = []
        for slot in self.slots:
            slot.drafts = []
            work = slot.work
            if work is None or work.drafting is None or slot.unread or not slot.to_decode:
                continue
            room = min(self.room - len(slot.tokens) - 2, work.limit - len(work.answer) - 1)
            if work.drafting.mode == "lookup":
                slot.drafts = work.drafting.propose_lookup(work.history, room)
                continue
            n = work.drafting.wanted(room)
            if n > 0:
                wants.append(Want(slot.seq_id, slot.tokens, slot.to_decode[0], n))
        if self.drafter is None or (not wants and not isinstance(self.drafter, MTPDrafter)):
            return
        started = time.perf_counter()
        drafts = self.drafter.draft(wants)  # MTP: also feeds its cache, drafts or not
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
            if not slot.reading_prompt or not is_image_token(slot.to_decode[0]):
                continue
            if work.cancelled.is_set():
                continue  # the loop's cancel check ends it before the next image
            pos = len(slot.tokens)
            span = work.media.spans[pos]
            try:
                self.vision.read_image(self.lm.ctx, span, pos, slot.seq_id, self.lm.n_batch)
            except RuntimeError as e:
                log.error("request %s: %s", work.request.id, e)
                self._fail_batch([(slot, 0, -1)], str(e))
                continue
            slot.tokens.extend(slot.to_decode[:span.n_tokens])
            del slot.to_decode[:span.n_tokens]
            slot.unread -= span.n_tokens
            work.emit(Progress(len(slot.tokens), len(work.prompt), prompt_cached=work.cached))

    def _fill_batch(self) -> list[tuple[Slot, int, int]]:
        """Put every answering slot's next token, then prompt chunks, into the batch.

        Returns (slot, tokens added, batch row whose logits to sample or -1) per slot."""
        batch = self.batch
        rows: list[tuple[Slot, int, int]] = []
        n = 0
        answering = [s for s in self.slots if s.work is not None and not s.unread
                     and s.to_decode]
        reading = sorted((s for s in self.slots if s.reading_prompt),
                         key=lambda s: s.work.started_ns)
        for slot in answering:
            if len(slot.tokens) + len(slot.to_decode) > self.room:
                self._finish(slot, "length")  # context full
                continue
            if slot.drafts:
                slot.drafts = slot.drafts[:max(0, self.lm.n_batch - n - 1)]
                slot.to_decode = slot.to_decode[:1] + slot.drafts
            slot.first_pos, slot.batch_row = len(slot.tokens), n
            for i, token in enumerate(slot.to_decode):
                n = self._put(n, token, len(slot.tokens) + i, slot.seq_id, True)
            rows.append((slot, len(slot.to_decode), slot.batch_row))
        budget = min(self.lm.n_batch, self._prompt_chunk) - n
        for slot in reading:
            if budget <= 0:
                break
            take = min(slot.unread, budget, _text_run(slot.to_decode, slot.unread))
            if take == 0:
                continue  # an image comes next: _read_images reads it before the next step
            if slot.replaying:  # a chunk replays KV or reads the prompt, never both
                take = min(take, slot.replaying)
            stop = self._checkpoint_stop(slot)
            if stop is not None:
                take = min(take, stop - len(slot.tokens))
            last = take == slot.unread and not slot.replaying
            slot.first_pos, slot.batch_row = len(slot.tokens), n
            every = slot.work.request.prompt_logprobs and not slot.replaying  # every row's
            for i in range(take):
                n = self._put(n, slot.to_decode[i], len(slot.tokens) + i, slot.seq_id,
                              every or (last and i == take - 1))
            rows.append((slot, take, n - 1 if last else -1))
            budget -= take
        batch.n_tokens = n
        return rows

    def _put(self, n: int, token: int, pos: int, seq: int, logits: bool) -> int:
        batch = self.batch
        batch.token[n] = token
        batch.pos[n] = pos
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = seq
        batch.logits[n] = logits
        return n + 1

    def _sample(self, slot: Slot, row: int) -> None:
        work = slot.work
        token = work.sampler.sample(self.lm.ctx, row)
        if self.tokenizer.is_eog(token):
            self._finish(slot, "stop")
            return
        self._append(work, row, token)
        slot.to_decode = [token]
        if len(work.answer) >= work.limit or len(slot.tokens) + 1 >= self.n_ctx:
            self._emit_text(slot, token)
            if slot.work is not None:
                self._finish(slot, "length")
            return
        slot.fresh = token

    def _append(self, work: Work, row: int, token: int) -> None:
        work.answer.append(token)
        if work.drafting is not None:
            work.history.append(token)
        self.tokens_generated += 1
        if work.request.logprobs is not None:
            work.pending_logprobs.append(self._logprob_entry(work, row, token))

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
            token = work.sampler.sample(self.lm.ctx, row + i)
            if self.tokenizer.is_eog(token):
                self._trim(slot, keep)
                self._finish(slot, "stop")
                break
            self._append(work, row + i, token)
            if i < len(drafts) and token == drafts[i]:
                accepted += 1
                work.draft_accepted += 1
                keep += 1  # already in the cache
                self._emit_text(slot, token)
                if slot.work is not None and len(work.answer) >= work.limit:
                    self._trim(slot, keep)
                    self._finish(slot, "length")
                if slot.work is None:
                    self._trim(slot, keep)
                    break
                continue
            self._trim(slot, keep)
            slot.to_decode = [token]
            self._emit_text(slot, token)
            if slot.work is not None and (len(work.answer) >= work.limit
                                          or keep + 1 >= self.n_ctx):
                self._finish(slot, "length")
            break
        if drafts:
            work.drafting.record(len(drafts), accepted)

    def _trim(self, slot: Slot, keep: int) -> None:
        """Drop the slot's KV cells from position `keep` on (rejected or unused drafts)."""
        if len(slot.tokens) > keep:
            if not llama_cpp.llama_memory_seq_rm(self.lm.memory, slot.seq_id, keep, -1):
                raise RuntimeError("llama.cpp could not take back rejected drafts")
            del slot.tokens[keep:]

    def _score_prompt(self, slot: Slot, n: int) -> None:
        """The logprobs of the prompt tokens that follow this step's `n` prompt rows (row i's
        logits predict the token after it; the last prompt row's predict the answer)."""
        work = slot.work
        start = len(slot.tokens)
        for i in range(n):
            following = start + i + 1
            if following < len(work.prompt):
                work.prompt_logprobs.append(
                    self._logprob_entry(work, slot.batch_row + i, work.prompt[following]))

    def _logprob_entry(self, work: Work, row: int, token: int) -> dict:
        logits = work.sampler.logits(self.lm.ctx, row)
        chosen, top = log_probs(logits, token, work.request.logprobs or 0)

        def entry(t: int, lp: float) -> dict:
            raw = self.tokenizer.token_bytes(t, special=True)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": lp,
                    "bytes": list(raw)}

        return {**entry(token, chosen), "top_logprobs": [entry(t, lp) for t, lp in top]}

    def _emit_text(self, slot: Slot, token: int) -> None:
        """Decode one answer token into text; hold back what may start a stop string."""
        work = slot.work
        work.pending_tokens += 1
        # special=True: control tokens the chat layer parses (<think>, gpt-oss's <|channel|>)
        # must reach it as text; end-of-generation tokens never get here.
        text = work.decoder.decode(self.tokenizer.token_bytes(token, special=True))
        text, hit = work.stops.feed(text)
        if text:
            work.emit(self._token_event(slot, text))
        if hit:
            self._finish(slot, "stop", stop_hit=True)

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

    def _finish(self, slot: Slot, reason: str, stop_hit: bool = False) -> None:
        work = slot.work
        if slot.fresh is not None and not stop_hit:
            token, slot.fresh = slot.fresh, None
            self._emit_text(slot, token)
            if slot.work is None:
                return  # that token completed a stop string
        slot.fresh = None
        if not stop_hit:
            tail = work.stops.flush() + work.decoder.decode(b"", final=True)
            if tail or work.pending_tokens:
                work.emit(self._token_event(slot, tail))
        eval_ns = work.eval_ns
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
            context_used=len(slot.tokens),
            n_ctx=self.n_ctx,
            context=tuple(text_tokens(work.prompt) if work.media else work.prompt)
            + tuple(work.answer),
            drafted=work.drafted,
            draft_accepted=work.draft_accepted,
            stop_sequence=work.stops.hit if stop_hit else None,
            prompt_logprobs=tuple(work.prompt_logprobs) if work.request.prompt_logprobs
            else None,
        ))
        if reason == "cancelled":
            log.info("request %s cancelled after %d answer tokens", work.request.id,
                     len(work.answer))
        work.sampler.free()
        if work.media is not None:
            work.media.free()
        slot.work = None
        slot.to_decode = []
        slot.unread = slot.replaying = 0
        slot.drafts = []
        slot.last_used = time.monotonic()

    def _fail_batch(self, rows: list[tuple[Slot, int, int]], code: int | str) -> None:
        """llama_decode refused the batch: fail the requests in it and forget their caches."""
        why = code if isinstance(code, str) else {
            1: "no room left in the KV cache", 2: "aborted"}.get(code, f"error {code}")
        for slot, _, _ in rows:
            work = slot.work
            if work is not None:
                work.sampler.free()
                if work.media is not None:
                    work.media.free()
                work.emit(Failure(f"llama_decode failed: {why}"))
            slot.work, slot.fresh, slot.to_decode, slot.unread = None, None, [], 0
            slot.replaying = 0
            llama_cpp.llama_memory_seq_rm(self.lm.memory, slot.seq_id, -1, -1)
            slot.tokens.clear()
            slot.checkpoints.clear()
            slot.drafts = []
            if self.drafter is not None:
                self.drafter.forget(slot.seq_id, 0)



def known_mode(mode: str) -> str:
    """The plan's speculative mode (Plan.from_dict already renamed older names), checked."""
    if mode not in SPECULATIVE_MODES:
        raise llama.ModelLoadError(f"unknown speculative mode {mode!r} in the plan; use "
                                   f"{', '.join(SPECULATIVE_MODES)}")
    return mode


def with_room_for_images(plan: Plan, projector_path: str) -> Plan:
    """A projector that attends across a whole image (Gemma 3's) needs the image's tokens in
    one micro-batch: raise n_ubatch (and n_batch) to the tokens of one image where short."""
    from localllm.modelstore.projector import projector_info

    tokens = projector_info(projector_path).tokens_per_image or 0
    if tokens <= plan.n_ubatch:
        return plan
    return replace(plan, n_ubatch=tokens, n_batch=max(plan.n_batch, tokens),
                   reasons=plan.reasons + (f"micro-batch raised to {tokens}: one image's "
                                           f"tokens are read in one",))


def prompt_chunk(plan: Plan, n_batch: int) -> int:
    """Prompt tokens read per step, from the plan alone: the same prompt is always read in the
    same chunks (llama.cpp's CPU kernels round a batch differently from its parts, so chunking
    that followed the clock would make greedy answers depend on the machine's load).

    With a GPU, whole micro-batches: weights kept in RAM cross to the GPU once per micro-batch
    (op offload), so a chunk that split one would pay that crossing again for its parts. As
    many as fit in CANCEL_BOUND_S at the plan's predicted prompt speed (at least one), so that a
    cancel, a new request and the other slots' next tokens wait about a second at most; one
    micro-batch runs as a whole on the GPU. On the CPU alone no weights cross: about
    STEP_TARGET_S of prompt per step, in a power of two (on a CPU a full n_batch chunk can take
    seconds)."""
    if plan.predicted_prefill_tps <= 0:
        return n_batch
    ubatch = min(plan.n_ubatch, n_batch)
    if plan.n_gpu_layers > 0 and ubatch >= MIN_PROMPT_CHUNK:
        per_step = int(plan.predicted_prefill_tps * CANCEL_BOUND_S) // ubatch
        return min(n_batch // ubatch, max(1, per_step)) * ubatch
    want = int(plan.predicted_prefill_tps * STEP_TARGET_S)
    chunk = MIN_PROMPT_CHUNK
    while chunk * 2 <= min(want, n_batch):
        chunk *= 2
    return min(chunk, n_batch)



def _text_run(tokens: list[int], limit: int) -> int:
    """How many of the first `limit` tokens come before the first image placeholder."""
    for i in range(limit):
        if is_image_token(tokens[i]):
            return i
    return limit
