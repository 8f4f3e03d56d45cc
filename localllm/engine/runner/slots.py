"""A slot: one sequence of the context, and the request it is serving.

The engine's context holds `n_parallel` sequences; each slot owns one (its seq id), the tokens
whose KV it holds (kept after a request ends, for the next request's prefix reuse) with the
checkpoints of its recurrent or sliding-window state (checkpoints.py), and while it
serves a request: the prompt still to read, the answer so far, its sampler, its stop matcher, its
UTF-8 decoder and its cancellation flag.
"""

from __future__ import annotations

import codecs
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localllm.engine.loaded import Sampler
from localllm.repeats import LoopGuard

from .checkpoints import SlotCheckpoints
from .protocol import Event, GenerationRequest
from .speculation import Drafting


class StopMatcher:
    """Holds back text that might be the start of a stop string, so none is ever streamed.

    The earliest stop in the text wins, whatever the order of the list; text held back is
    released by `flush` when the answer ends for another reason."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.pending = ""
        self.hit: str | None = None  # the stop string that ended the answer

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [(at, stop) for stop in self.stops if (at := self.pending.find(stop)) >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda hit: hit[0])
            out, self.pending = self.pending[:at], ""
            return out, True
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(stop[:n]):
                    keep = n
                    break
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


@dataclass
class Work:
    """One generation request in a slot."""

    request: GenerationRequest
    emit: Callable[[Event], None]
    cancelled: threading.Event
    prompt: list[int]
    sampler: Sampler
    limit: int  # answer tokens at most
    cached: int = 0  # prompt tokens reused from the slot's KV
    # where they came from: "slot" (its KV cut back), "checkpoint" (cut back to a checkpoint,
    # `checkpoint` its position), "prompt cache" (a saved prompt restored, then cut back, to a
    # checkpoint of it where `checkpoint` is set); "" when nothing was reused
    cached_from: str = ""
    checkpoint: int | None = None
    truncated: int = 0  # prompt tokens left out to fit the context (request.truncate)
    stops: StopMatcher = field(init=False)
    decoder: codecs.IncrementalDecoder = field(init=False)
    loops: LoopGuard | None = field(init=False)
    answer: list[int] = field(default_factory=list)
    pending_tokens: int = 0  # answer tokens behind text not emitted yet
    pending_logprobs: list[dict] = field(default_factory=list)
    prompt_logprobs: list[dict] = field(default_factory=list)  # request.prompt_logprobs
    started_ns: int = field(default_factory=time.perf_counter_ns)
    prompt_done_ns: int = 0
    drafted: int | None = None  # set (to 0) when the request drafts
    draft_accepted: int | None = None
    drafting: Drafting | None = None
    history: list[int] = field(default_factory=list)  # prompt + answer, for the drafter
    media: object | None = None  # vision.MediaPrompt: the prompt's images (freed at the end)

    def __post_init__(self) -> None:
        self.stops = StopMatcher(self.request.options.stop)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # An answer without a token cap that loops would run to the context's end (an editor's
        # request streamed one for 400 s): the chat's guard stops it, done_reason "loop". A
        # grammar's output (JSON) may repeat on purpose and ends by the grammar.
        self.loops = LoopGuard() if self.request.options.num_predict < 0 \
            and self.request.grammar is None else None

    @property
    def prompt_ns(self) -> int:
        return self.prompt_done_ns - self.started_ns if self.prompt_done_ns else 0

    @property
    def eval_ns(self) -> int:
        return time.perf_counter_ns() - self.prompt_done_ns if self.prompt_done_ns else 0


@dataclass
class Room:
    """The context sizes every part of the engine's loop reads (a fill band switch changes
    them): `n_ctx`, the tokens one request may use (the last band's context, reported in
    Done); `seq`, the KV cells each sequence has in the band loaded now."""
    n_ctx: int
    seq: int


class Slot:
    def __init__(self, seq_id: int):
        self.seq_id = seq_id
        self.tokens: list[int] = []  # tokens whose KV this sequence holds, in position order
        # copies of its recurrent or sliding-window state at some of those positions
        self.checkpoints = SlotCheckpoints()
        self.work: Work | None = None
        self.to_decode: list[int] = []  # tokens to put in the next batch (prompt or answer)
        self.unread: int = 0  # how many of to_decode are prompt tokens still to read
        # how many of those unread are the sequence's own KV, read again (a band switch whose
        # state could not carry over): no progress, no logits, the prompt's timing unchanged
        self.replaying: int = 0
        self.fresh: int | None = None  # sampled and decoded, its text not yet handled
        self.drafts: list[int] = []  # draft tokens for (then in) the batch being decoded
        self.first_pos = 0  # where this step's tokens start in the sequence
        self.batch_row = 0  # and in the batch
        self.last_used = 0.0

    @property
    def free(self) -> bool:
        return self.work is None

    @property
    def reading_prompt(self) -> bool:
        return self.work is not None and self.unread > 0
