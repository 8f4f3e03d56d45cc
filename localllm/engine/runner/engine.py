"""The runner's engine: one loaded model, `n_parallel` slots, one loop that drives them all.

Runs inside the runner process only (see __main__.py): a crash in here takes down that process,
never the daemon.

The engine takes requests in (a queue any thread may fill), admits them into free slots (the
slot whose cache serves the prompt best: reuse.py) and runs the loop. Each turn of the loop is
one decode step (step.py) whose batch carries the next token of every slot that is answering
plus a chunk of any prompt being read (continuous batching: a new request joins at the next
step). Prompts are read in chunks of at most `n_batch` tokens, whole micro-batches on a GPU
(see prompt_chunk), so a cancel or a new request never waits for a whole long prompt. The model
and everything bound to it is engine/loaded.py's; fill band switches are bands.py's.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localllm.engine.loaded import LoadedModel
from localllm.engine.model import ModelLoadError, PromptTooLong, RequestError
from localllm.engine.vision import MediaPrompt, is_image_token, text_tokens
from localllm.planner.plan import Plan

from localllm.speculative import ALIASES, BY_NAME, MAX_DRAFT, VOCAB_SLACK, Mode, UnknownMode
from localllm.speculative import mode as mode_row

from . import checkpoints
from .bands import FillBands
from .disk_cache import SHUTDOWN_WRITE_S, DiskCache
from .load import Load
from .protocol import (
    CpuShare,
    Done,
    Embeddings,
    EmbedRequest,
    Event,
    Failure,
    GenerationRequest,
    Threads,
    TokenCount,
    TokenizeRequest,
)
from .replies import Replies
from .reuse import PromptCache, PromptReuse
from .slots import Room, Slot, Work
from .speculation import Drafting, StepCosts
from .step import Steps
from .threads import ThreadGovernor

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


class RunnerEngine:
    def __init__(self, model_path: str, plan: Plan, draft_model_path: str | None = None,
                 adapt_threads: bool = True, projector_path: str | None = None,
                 prompt_cache_bytes: int = 0, bands: tuple[Plan, ...] = (),
                 start_band: int = 0, prompt_disk: tuple[str, int] | None = None):
        """`bands`: plans for smaller contexts than `plan`'s, smallest first (fill bands: less
        KV leaves VRAM for more of the weights). The engine starts in `start_band` and moves
        up when a sequence needs more room (bands.py); `plan` is the last band. What to load
        is decided in the daemon's planning (daemon/planner.py): the bands (none beside a
        projector or a drafter bound to the model) and the images' micro-batch come as given.
        `prompt_disk`: the prompt cache's folder on disk and its budget in bytes (None: none)."""
        plans = (*bands, plan)
        start = max(0, min(start_band, len(plans) - 1))
        plan = plans[start]
        self.adapt_threads = adapt_threads
        drafting = known_mode(plan)  # an unknown mode fails before llama.cpp reads the model
        self.model = LoadedModel(model_path, plan, draft_model_path=draft_model_path,
                                 projector_path=projector_path, vocab_slack=VOCAB_SLACK)
        lm = self.model.lm
        # The longest draft. The plan's draft_n_max bounds what costs memory: recurrent-state
        # snapshots (llama.cpp keeps one per position a rejected draft may take back, plus one
        # for the MTP prefix rule) and MTP's chained passes, whose acceptance falls fast after a
        # few. Prompt lookup and a draft model on an attention model cost nothing to allow
        # longer: the per-request length adapts to the acceptance measured (the plan chose its
        # length for an assumed one).
        self.draft_cap = plan.draft_ceiling() if drafting.plan_bounds_length or lm.recurrent \
            else MAX_DRAFT
        # What one request may use (the last band's context) and what the loaded band holds.
        self.room = Room(n_ctx=lm.n_ctx_seq if start == len(plans) - 1 else plans[-1].n_ctx,
                         seq=lm.n_ctx_seq)
        self.slots = [Slot(i) for i in range(lm.n_seq)]
        self.inbox: queue.Queue[Submission | Question | None] = queue.Queue()
        self.backlog: collections.deque[Submission] = collections.deque()
        self._closing = False
        # Tokens between checkpoints of a long prompt; 0: a model of full attention only, whose
        # KV is cut back anywhere, needs none (checkpoints.py)
        spacing = checkpoints.spacing(self.room.n_ctx) if lm.recurrent or lm.n_swa else 0
        self.reuse = PromptReuse(self.model, *prompt_caches(
            self.model, model_path, drafting, prompt_cache_bytes, prompt_disk), spacing)
        self.bands = FillBands(plans, start, self.model, self.slots, self.room,
                               stash=self.reuse.stash)
        self.replies = Replies(self.model, self.room)
        self.step_costs = StepCosts(per_token_prior=0.1 if plan.n_gpu_layers > 0 else 0.6)
        self.steps = Steps(self.model, self.slots, self.room, self.replies, self.reuse,
                           self.step_costs)
        # Fewer decode threads while other processes hold cores (threads.py); each change
        # goes to `steps.on_threads` (the runner tells the daemon, which shows it in ps).
        self._pace(plan)

    @classmethod
    def from_load(cls, load: Load) -> RunnerEngine:
        """The engine of the daemon's load (the op table's first op)."""
        def path(p) -> str | None:
            return str(p) if p is not None else None

        return cls(str(load.model_path), load.plan, path(load.draft_path),
                   projector_path=path(load.projector),
                   prompt_cache_bytes=load.prompt_cache_bytes, bands=load.bands,
                   start_band=load.start_band,
                   prompt_disk=(str(load.prompt_disk_dir), load.prompt_disk_bytes)
                   if load.prompt_disk_dir is not None else None)

    def _pace(self, plan: Plan) -> None:
        """Prompt chunks and decode threads for the plan loaded (at start, after a band switch)."""
        steps = self.steps
        steps.plan = plan
        steps.prompt_chunk = prompt_chunk(plan, self.model.lm.n_batch)
        steps.threads = ThreadGovernor(plan.n_threads, plan.predicted_decode_tps,
                                       plan.predicted_decode_by_depth) \
            if self.adapt_threads else None
        steps.n_threads = plan.n_threads
        if steps.cpu_share > 1:  # a band's new context starts at the plan's threads
            steps.set_threads()
        self.drafting_modes = drafting_modes(self.drafter, self.lm, self.draft_cap)

    # ---- what the runner's main and the benchmarks read -------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.room.n_ctx

    @property
    def lm(self):
        return self.model.lm

    @property
    def drafter(self):
        return self.model.drafter

    @property
    def plan(self) -> Plan:
        return self.bands.plan

    @property
    def n_threads(self) -> int:
        return self.steps.n_threads

    @property
    def tokens_generated(self) -> int:
        return self.steps.tokens_generated

    # ---- requests in (protocol.OPS names these methods) -------------------------------------
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
        return TokenCount(len(self.model.tokenizer.tokenize(text)))

    def count_tokens_each(self, texts: list[str]) -> TokenCount:
        counts = tuple(len(self.model.tokenizer.tokenize(t, add_bos=False)) for t in texts)
        return TokenCount(sum(counts), counts)

    def share_cpu(self, request: CpuShare) -> Threads:
        return self.steps.share_cpu(request.runners)

    def embed(self, request: EmbedRequest) -> Embeddings:
        """Embeddings in a context of their own, made on first use (engine/embedding.py)."""
        started = time.perf_counter_ns()
        embedder = self.model.embedder(self.n_ctx, self.plan)
        vectors, total = embedder.answer(request.inputs, request.truncate, request.dimensions,
                                         request.query)
        return Embeddings(vectors=tuple(vectors), prompt_tokens=total,
                          duration_ns=time.perf_counter_ns() - started)

    def _take_inbox(self, block: bool) -> None:
        if not block and not self.inbox.qsize():
            return  # between two decode steps: the queue's lock and its Empty cost more
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
        from localllm.engine.embedding import EmbedInputError

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
                sub.emit(Failure(str(e), status=400, context_exceeded=e.sizes))
            except Exception as e:  # this request fails, not the runner
                log.exception("request %s could not start", sub.request.id)
                sub.emit(Failure(f"{type(e).__name__}: {e}"))

    def _start(self, sub: Submission, free: list[Slot]) -> None:
        request = sub.request
        media = self._tokenize_media(request) if request.images else None
        try:
            tokens = media.tokens if media else self.model.tokenizer.tokenize(request.prompt)
            truncated = 0
            if request.truncate and media is None and len(tokens) >= self.n_ctx:
                tokens, truncated = truncated_prompt(tokens, self.n_ctx,
                                                     request.options.num_predict,
                                                     self.model.tokenizer.bos)
                log.info("request %s: the prompt was %d tokens; left out %d (the oldest after "
                         "the first) to fit the %d-token context", request.id,
                         len(tokens) + truncated, truncated, self.n_ctx)
            self._check_prompt(tokens, media)
            slot = self.reuse.choose_slot(free, tokens, media)
            # scoring the prompt reads all of it
            kept = self.reuse.keep_prefix(slot, tokens, media,
                                          reuse=not request.prompt_logprobs)
            options = request.options
            sampler = self.model.sampler(options, request.grammar,
                                         text_tokens(tokens) if media else tokens, self.n_ctx)
        except BaseException:
            if media is not None:
                media.free()
            raise
        limit = options.num_predict if options.num_predict >= 0 else self.n_ctx
        slot.work = work = Work(request=request, emit=sub.emit, cancelled=sub.cancelled,
                                prompt=tokens, sampler=sampler, limit=limit,
                                cached=kept.tokens, cached_from=kept.source,
                                checkpoint=kept.checkpoint, truncated=truncated)
        work.media = media
        # Drafters read token ids: a prompt with image placeholders is answered without them.
        mode = None if media else self._drafting_mode(request)
        if mode is not None:
            work.drafting = Drafting(self.step_costs, mode, max_length=self.draft_cap)
            work.history = list(tokens)
            work.drafted, work.draft_accepted = 0, 0
        slot.to_decode = tokens[kept.tokens:]
        slot.unread = len(slot.to_decode)
        if request.prompt_logprobs:
            self.replies.first_prompt_entry(work)

    def _tokenize_media(self, request: GenerationRequest) -> MediaPrompt:
        if self.model.vision is None:
            raise RequestError("this model does not support images (it was loaded without a "
                               "vision projector)")
        tokenizer = self.model.tokenizer
        add_bos = tokenizer.add_bos and not (
            tokenizer.bos_piece and request.prompt.startswith(tokenizer.bos_piece))
        return self.model.vision.tokenize(request.prompt, request.images, add_bos)

    def _check_prompt(self, tokens: list[int], media: MediaPrompt | None) -> None:
        if not tokens:
            raise RequestError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            images = ""
            if media is not None:
                images = (f" ({media.image_tokens} of them for {len(media.spans)} "
                          f"image{'s' if len(media.spans) != 1 else ''})")
            trained = self.model.n_ctx_train
            bigger = (f"load the model with a larger num_ctx (it was trained on {trained} "
                      f"tokens)" if trained > self.n_ctx else
                      f"use a model with a longer context ({self.n_ctx} tokens is all this "
                      f"one was trained on)")
            raise PromptTooLong(
                f"the prompt is {len(tokens)} tokens{images} but the loaded context holds "
                f"{self.n_ctx}; shorten it{', send fewer images' if images else ''} or "
                f"{bigger}", len(tokens), self.n_ctx)
        if media is not None and is_image_token(tokens[-1]):  # (text tokens are never one)
            raise RequestError("the prompt ends with an image: put text after it")

    def _drafting_mode(self, request: GenerationRequest) -> str | None:
        """Where this request's drafts come from (`options.speculative`, which the daemon
        resolved: `auto` never reaches the runner), or None, as decided at load
        (`drafting_modes`)."""
        name = request.options.speculative
        if name not in self.drafting_modes:
            try:
                mode_row(name)  # not a mode: it names the modes there are
            except UnknownMode as e:
                raise RequestError(str(e)) from None
        mode, refused = self.drafting_modes[name]
        if refused:
            raise RequestError(refused)
        return mode

    # ---- the loop --------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until `close()` and nothing is left in flight; then the prompts go to disk
        where there is a disk cache."""
        while True:
            busy = any(not slot.free for slot in self.slots)
            self._take_inbox(block=not busy and not self.backlog and not self._closing)
            self._admit()
            self._drop_cancelled()
            if self._closing and not self.backlog and all(s.free for s in self.slots):
                self.reuse.save_all(self.slots, time.monotonic() + SHUTDOWN_WRITE_S)
                return
            try:
                self.step()
            except Exception as e:  # a failed step ends the requests in it, not the runner
                log.exception("decode step failed")
                self.replies.fail([s for s in self.slots if not s.free],
                                  f"{type(e).__name__}: {e}")

    def _drop_cancelled(self) -> None:
        for slot in self.slots:
            if slot.work is not None and slot.work.cancelled.is_set():
                self.replies.finish(slot, "cancelled")

    def step(self) -> None:
        """One decode step (step.py), in the fill band that holds every sequence."""
        if len(self.bands.plans) > 1:  # a load without bands has no switch to make
            switched = self.bands.follow()
            if switched is not None:
                self._pace(switched)
        self.steps.step()


def prompt_caches(model: LoadedModel, model_path: str, drafting: Mode, ram_bytes: int,
                  disk: tuple[str, int] | None) -> tuple[PromptCache | None, DiskCache | None]:
    """The prompt caches of a load: prompts of slots taken for other requests, in RAM
    (reuse.py), and long prompts kept on disk past this runner (disk_cache.py). Neither with
    MTP: its own cache of each sequence would have to be saved and restored beside the
    target's."""
    lm = model.lm
    keep_contained = bool(lm.n_swa or lm.recurrent)
    ram = PromptCache(ram_bytes, keep_contained) if ram_bytes > 0 and drafting.prompt_cache \
        else None
    on_disk = None
    if disk is not None and disk[1] > 0 and drafting.prompt_cache:
        on_disk = DiskCache(Path(disk[0]), disk[1], model, model_path, keep_contained)
    return ram, on_disk


def drafting_modes(drafter, lm, draft_cap: int) -> dict[str, tuple[str | None, str]]:
    """What each `speculative` a request may send means on the model as loaded (decided at
    load and after a band switch): the mode its drafts come from (None: it does not draft) and
    why it is refused ("": it is not). A drafter loaded with the model (MTP, a draft model)
    must be the one asked for (the daemon reloads the model when a request asks for another);
    a recurrent state can take drafts back only when the plan drafts (llama.cpp then keeps
    snapshots of it)."""
    decided = {}
    for name in (*BY_NAME, *ALIASES):
        row = mode_row(name)
        if not row.drafts:
            decided[name] = (None, "")
        elif row.loaded and (drafter is None or drafter.kind != row.name):
            decided[name] = (None, f"speculative '{row.name}': the model was loaded without "
                                   f"{row.help}")
        elif lm.recurrent and lm.n_rollback < draft_cap:
            decided[name] = (None, "")
        else:
            decided[name] = (row.name, "")
    return decided


def known_mode(plan: Plan) -> Mode:
    """The row of the plan's speculative mode (Plan.from_dict already renamed older names)."""
    try:
        return plan.draft_mode
    except UnknownMode as e:
        raise ModelLoadError(f"{e} (in the plan)") from None


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


def truncated_prompt(tokens: list[int], n_ctx: int, num_predict: int,
                     bos: int) -> tuple[list[int], int]:
    """A prompt the context cannot hold cut as Ollama's runner cuts it: its first token where
    that is the BOS, then its newest tokens, leaving room for the answer (what it asked for,
    64 tokens at least, a quarter of the context at most; 256 where it set no limit).
    (tokens, left out)."""
    answer = min(max(num_predict, 64) if num_predict > 0 else 256, n_ctx // 4)
    room = max(1, n_ctx - max(answer, 1))
    head = tokens[:1] if tokens and tokens[0] == bos else []
    kept = head + tokens[len(tokens) - (room - len(head)):]
    return kept, len(tokens) - len(kept)

