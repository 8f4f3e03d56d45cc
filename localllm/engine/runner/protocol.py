"""What the API layer asks of the engine and what the engine answers, free of any wire format.

The chat layer turns an Ollama or OpenAI request into a `GenerationRequest` (a rendered prompt,
sampling options, a grammar); the runner answers with `Progress` and `Token` events and one
`Done` (or a `Failure`). Embedding and tokenize requests get one answer each. All of these cross
the pipe to the runner process as JSON lines (`to_wire` / `event_from_wire`), and the timeouts
both sides keep are here too.

`OPS` is the one table of what a runner serves: each op's request type, the events that end it
and the RunnerEngine method that answers it. The runner's command loop (__main__.py) and the
daemon's RunnerProcess (engine/local.py) both read it, so a new op is a request type and its
answer here, a row in `OPS`, the RunnerEngine method, and (for the daemon's callers) a RunnerProcess
method. Its first op is the load: the daemon's frozen `Load` (load.py) as one value, rebuilt as
the same dataclass in the runner, answered by one `Loaded` event (or a Failure); the runner
decides nothing about it again. The tuner's ops (engine/probes.py: a dry run, a
measurement...) are rows too, each the first and only line of a runner of its own, answered by
tuner_ops.py with its typed result (engine/probing.py asks).
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

from localllm.engine.expert_cache import ExpertCacheStats
from localllm.engine.probes import (
    Bandwidth,
    Buffers,
    Calibrate,
    Chunks,
    DryRun,
    Evaluate,
    Evaluation,
    KernelRates,
    Measure,
    Measurement,
    RpcProbe,
    TimeKernels,
    Workers,
)

from localllm.options import SamplingOptions

from .load import Load

DEFAULT_CTX = 4096
# Where an image goes in a prompt: mtmd's default media marker (mtmd_default_marker()).
IMAGE_MARKER = "<__media__>"
# A runner serving a request sends something (a token, prompt progress after each chunk) well
# within this; one that stays silent longer is taken for hung and stopped.
RUNNER_SILENCE_S = 300.0

# The runner program: the daemon starts one per loaded model (engine/local.py), the tuner one
# per measurement (engine/probing.py).
RUNNER_COMMAND = (sys.executable, "-m", "localllm.engine.runner")


def new_request_id() -> str:
    """A request's id on the pipe (and in the daemon's logs)."""
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class GenerationRequest:
    id: str
    # The whole prompt as text, templates already applied by the chat layer: special tokens in
    # it are parsed, and a BOS is added when the model wants one and the text lacks it.
    prompt: str = ""
    options: SamplingOptions = field(default_factory=SamplingOptions)
    grammar: str | None = None  # GBNF (root rule "root") constraining the answer
    logprobs: int | None = None  # None: off; N >= 0: each token's logprob and the top N
    # With logprobs: the prompt's own tokens' logprobs too (OpenAI's `echo`), on Done. The
    # whole prompt is then read afresh: a reused prefix has no logits left.
    prompt_logprobs: bool = False
    # Base64 image files, one per IMAGE_MARKER in `prompt`, in order.
    images: tuple[str, ...] = ()
    # A prompt longer than the context: keep its first token (the BOS) and its newest ones,
    # leaving room for the answer, as Ollama's `truncate` does; False: a 400 (Done reports the
    # tokens left out as prompt_truncated)
    truncate: bool = False

    def to_wire(self) -> dict:
        return request_to_wire(self)

    @classmethod
    def from_wire(cls, data: dict) -> GenerationRequest:
        options = dict(data.get("options") or {})
        options["stop"] = tuple(options.get("stop") or ())
        return cls(
            id=data["id"],
            prompt=str(data.get("prompt") or ""),
            options=SamplingOptions(**options),
            grammar=data.get("grammar"),
            logprobs=data.get("logprobs"),
            prompt_logprobs=bool(data.get("prompt_logprobs")),
            images=tuple(data.get("images") or ()),
            truncate=bool(data.get("truncate")),
        )


@dataclass(frozen=True)
class Token:
    kind: ClassVar[str] = "token"
    text: str
    n_tokens: int = 1  # tokens behind this text (stop-string hold-back can merge several)
    # Running totals of this request when the text was emitted, measured in the runner, so a
    # client can show live decode speed and context use without guessing.
    eval_count: int = 0  # answer tokens so far
    eval_duration_ns: int = 0  # decode time so far (since the prompt was evaluated)
    prompt_eval_count: int = 0
    prompt_eval_duration_ns: int = 0
    context_used: int = 0  # prompt + answer tokens so far
    drafted: int | None = None  # speculative decoding: draft tokens proposed so far (None: off)
    draft_accepted: int | None = None  # ... and how many of them the target model accepted
    # With GenerationRequest.logprobs: one entry per token behind `text`:
    # {"token": str, "logprob": float, "bytes": [int], "top_logprobs": [{"token", "logprob",
    # "bytes"}]}
    logprobs: tuple[dict, ...] | None = None


@dataclass(frozen=True)
class Done:
    kind: ClassVar[str] = "done"
    done_reason: str  # "stop", "length", "cancelled", "loop" (repeating, with no token cap)
    prompt_eval_count: int  # prompt tokens actually evaluated (after prefix reuse)
    prompt_eval_duration_ns: int
    eval_count: int
    eval_duration_ns: int
    prompt_tokens: int  # whole prompt, including the reused prefix
    cached_tokens: int  # prompt tokens reused from the KV cache
    context_used: int  # tokens in the KV cache after this request
    n_ctx: int
    context: tuple[int, ...] = ()  # prompt + answer tokens (Ollama generate's `context`)
    drafted: int | None = None  # speculative decoding totals, as on Token (None: off)
    draft_accepted: int | None = None
    stop_sequence: str | None = None  # the stop string that ended the answer, if one did
    # With GenerationRequest.prompt_logprobs: one entry per prompt token, as Token.logprobs,
    # the first with logprob None (nothing comes before it); `added` marks a BOS the
    # tokenizer put in front of the text (it has no characters in it).
    prompt_logprobs: tuple[dict, ...] | None = None
    # where the reused tokens came from: "slot", "checkpoint", "prompt cache" ("" for none),
    # and the position of the checkpoint of the recurrent or sliding-window state restored
    cached_from: str = ""
    checkpoint: int | None = None
    prompt_truncated: int = 0  # prompt tokens left out to fit the context (request.truncate)


@dataclass(frozen=True)
class Progress:
    """Prompt reading, between chunks: how many prompt tokens are in the cache so far; or,
    with a `note`, a pause of the request's decoding (a fill band switch) and why."""
    kind: ClassVar[str] = "progress"
    prompt_read: int
    prompt_total: int
    note: str = ""
    prompt_cached: int = 0  # of prompt_total, the tokens reused from the cache (not read)


@dataclass(frozen=True)
class EmbedRequest:
    id: str
    inputs: tuple[str, ...]
    truncate: bool = True  # cut inputs longer than the embedding context (else a 400)
    dimensions: int | None = None  # keep the first N dimensions (then normalize again)
    # A reranker's request: the inputs are documents scored against this query, and each
    # vector of the answer is one score (engine/embedding.py: Embedder.rank).
    query: str | None = None

    def to_wire(self) -> dict:
        return request_to_wire(self)

    @classmethod
    def from_wire(cls, data: dict) -> EmbedRequest:
        return cls(id=data["id"], inputs=tuple(data["inputs"]),
                   truncate=bool(data.get("truncate", True)), dimensions=data.get("dimensions"),
                   query=data.get("query"))


@dataclass(frozen=True)
class TokenizeRequest:
    """How many tokens `text` is as a raw prompt; or, with `texts`, each text's count
    (tokenized without BOS) and their sum."""
    id: str
    text: str = ""
    texts: tuple[str, ...] | None = None

    def to_wire(self) -> dict:
        return request_to_wire(self)

    @classmethod
    def from_wire(cls, data: dict) -> TokenizeRequest:
        texts = data.get("texts")
        return cls(id=data["id"], text=str(data.get("text", "")),
                   texts=tuple(str(t) for t in texts) if isinstance(texts, list) else None)


@dataclass(frozen=True)
class CpuShare:
    """How many of the daemon's runners compute on the CPU at once now, this one among them:
    the runner caps its threads at its plan's share (`runners` 1: the plan's own counts).
    Answered with a Threads event."""
    id: str
    runners: int

    def to_wire(self) -> dict:
        return request_to_wire(self)

    @classmethod
    def from_wire(cls, data: dict) -> CpuShare:
        return cls(id=data["id"], runners=max(1, int(data["runners"])))


@dataclass(frozen=True)
class Embeddings:
    kind: ClassVar[str] = "embeddings"
    vectors: tuple[tuple[float, ...], ...]  # unit length, one per input (a rank: its score)
    prompt_tokens: int  # tokens read over all inputs
    duration_ns: int = 0


@dataclass(frozen=True)
class TokenCount:
    """The answer to {"op": "tokenize", "id", "text"}: tokens the text is as a raw prompt; to
    {"op": "tokenize", "id", "texts": [...]}: each text's count (tokenized without BOS) and
    their sum."""
    kind: ClassVar[str] = "tokens"
    count: int
    counts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Threads:
    """Sent by the runner on its own (no request id) when it changes its decode threads, and as
    the answer to a CpuShare."""
    kind: ClassVar[str] = "threads"
    n_threads: int
    reason: str


@dataclass(frozen=True)
class Band:
    """Sent by the runner on its own when it moved to another fill band's plan (engine.py):
    `band` indexes the bands of the load message, `n_ctx` is the room each sequence has now."""
    kind: ClassVar[str] = "band"
    band: int
    n_ctx: int
    pause_s: float  # how long decoding stopped: states saved, model reloaded, states restored
    carried: int  # sequences whose KV came over
    reread: int  # tokens read again (sequences whose state could not come over)
    reason: str


@dataclass(frozen=True)
class Loaded:
    """The answer to the load: what the runner holds now, as llama.cpp made it."""
    kind: ClassVar[str] = "loaded"
    pid: int
    load_duration_ns: int
    n_ctx: int  # the context a request may fill (the whole plan's, when it starts in a band)
    n_parallel: int
    weights_in_ram: str = ""  # what holds the weights in RAM (engine/model.py)
    expert_cache: dict | None = None  # the pool's ExpertCacheStats fields (None: none made)
    past_ram: dict | None = None  # weights locked in RAM and those read per token (resident)
    # why the runner loaded without llama.cpp's extra buffer types that the plan had on (an
    # engine built with AMX on an AMX CPU: engine/cpu.py amx_hazard); "" when it did as planned
    extra_bufts_off: str = ""


@dataclass(frozen=True)
class Failure:
    kind: ClassVar[str] = "error"
    message: str
    status: int = 500  # 400 when the request itself was at fault (prompt too long, no template)
    context_exceeded: tuple[int, ...] = ()  # (prompt tokens, n_ctx) for a prompt too long


Event = (Token | Done | Failure | Progress | Embeddings | TokenCount | Threads | Band
         | ExpertCacheStats | Loaded | Buffers | Measurement | Evaluation | Workers | Bandwidth
         | KernelRates | Chunks)
Request = (Load | GenerationRequest | EmbedRequest | TokenizeRequest | CpuShare | DryRun
           | Measure | Evaluate | RpcProbe | Calibrate | TimeKernels)


@dataclass(frozen=True)
class Op:
    """One thing the daemon asks a runner. `request` reads it from the wire (its from_wire);
    an event of `ends` is its last; the RunnerEngine's `method` serves it. `stream`: served step by
    step by the engine's loop, with a cancel flag (RunnerEngine.submit(request, emit, cancelled));
    otherwise `method(request)` computes its one answer between two decode steps. `alone`: an
    op of the tuner's (engine/probes.py), the program's first and only line, answered
    by `method` of tuner_ops.py with no model loaded; the program then ends."""
    name: str
    request: type
    ends: tuple[type, ...]
    method: str
    stream: bool = False
    alone: bool = False


OPS = (
    # the first line a runner reads; its method is the RunnerEngine's constructor from the Load
    Op("load", Load, (Loaded, Failure), "from_load"),
    Op("generate", GenerationRequest, (Done, Failure), "submit", stream=True),
    Op("embed", EmbedRequest, (Embeddings, Failure), "embed"),
    Op("tokenize", TokenizeRequest, (TokenCount, Failure), "tokenize"),
    Op("share", CpuShare, (Threads, Failure), "share_cpu"),
    # the tuner's measurements, each in a runner of its own (tuner_ops.py says why)
    Op("dry_run", DryRun, (Buffers, Failure), "dry_run", alone=True),
    Op("measure", Measure, (Measurement, Failure), "measure", alone=True),
    Op("evaluate", Evaluate, (Evaluation, Failure), "evaluate", alone=True),
    Op("rpc_probe", RpcProbe, (Workers, Failure), "rpc_probe", alone=True),
    Op("calibrate", Calibrate, (Bandwidth, Failure), "calibrate", alone=True),
    Op("kernel_rates", TimeKernels, (KernelRates, Failure), "time_kernels", alone=True),
)
OP_BY_NAME = {op.name: op for op in OPS}
OP_OF_REQUEST = {op.request: op for op in OPS}
# Events that end a request (after one, nothing more comes for its id)
ENDING_EVENTS = tuple(dict.fromkeys(cls for op in OPS for cls in op.ends))
# Every event on the wire: those that end requests, progress on the way, and what the runner
# sends on its own (no request id: a change of threads or of fill band, the expert cache's figures)
EVENTS = tuple(dict.fromkeys((*ENDING_EVENTS, Token, Progress, Chunks, Threads, Band,
                                  ExpertCacheStats)))
EVENT_KINDS = {cls: cls.kind for cls in EVENTS}  # each class's "event" on the wire
EVENT_BY_KIND = {cls.kind: cls for cls in EVENTS}


def request_to_wire(request) -> dict:
    return {"id": "", **asdict(request), "op": OP_OF_REQUEST[type(request)].name}


def event_to_wire(request_id: str, event: Event) -> dict:
    return {"event": EVENT_KINDS[type(event)], "id": request_id, **asdict(event)}


def event_from_wire(data: dict) -> Event:
    """An event back from its JSON line (an unknown kind reads as a Failure)."""
    kind = data.pop("event")
    data.pop("id", None)
    cls = EVENT_BY_KIND.get(kind, Failure)
    if hasattr(cls, "from_wire"):  # a result holding values of its own (Evaluation, Workers)
        return cls.from_wire(data)
    return cls(**{name: _frozen(value) for name, value in data.items()})


def _frozen(value):
    """JSON's lists back into the tuples the frozen events hold (lists of lists too: the
    embedding vectors); the dicts inside (logprob entries) stay as JSON gave them."""
    if isinstance(value, list):
        return tuple(_frozen(v) if isinstance(v, list) else v for v in value)
    return value


class TokenCoalescer:
    """Sends Token events at most every EMIT_INTERVAL_S, merged; other events at once.

    A small model on a few cores makes 100+ tokens a second; one pipe line, one HTTP chunk and
    one client parse per token then take CPU from llama.cpp's own threads. Merging tokens that
    come faster than a screen refresh keeps the decode speed without making the stream jerky:
    a token waits at most one token's time, and the first one goes out at once. `on_end` runs
    after the request's last event (Done or Failure).
    """

    EMIT_INTERVAL_S = 0.025

    def __init__(self, send, on_end=None):
        self.send = send
        self.on_end = on_end
        self.pending: Token | None = None
        self.last_sent = 0.0

    def __call__(self, event: Event) -> None:
        if isinstance(event, Token):
            if self.pending is not None:
                event = _merged(self.pending, event)
            now = time.monotonic()
            if now - self.last_sent >= self.EMIT_INTERVAL_S:
                self.send(event)
                self.pending, self.last_sent = None, now
            else:
                self.pending = event
            return
        if self.pending is not None:
            self.send(self.pending)
            self.pending = None
        self.send(event)
        if isinstance(event, (Done, Failure)) and self.on_end is not None:
            self.on_end()


def _merged(first: Token, then: Token) -> Token:
    logprobs = None
    if first.logprobs is not None or then.logprobs is not None:
        logprobs = (first.logprobs or ()) + (then.logprobs or ())
    return replace(then, text=first.text + then.text, n_tokens=first.n_tokens + then.n_tokens,
                   logprobs=logprobs)
