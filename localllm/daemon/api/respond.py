"""One response pipeline for every wire format: a `ChatRequest` checked, prepared and run on
the model's Engine (engine/seam.py: the local runner, or a remote model's upstream), its
tokens parsed into parts, and the parts handed to the wire format's `Writer`, streamed or whole.

A route parses its body into a ChatRequest and picks its writer; `respond` does the rest the
same way for all of them: check and render the request (a 400 comes before the model loads),
hold the model's engine (a runner from the scheduler, loading it if need be), drop the oldest
turns that do not fit its context, read the first event before any header is sent (a failure there
is still an HTTP error), then `start`, a `part` for each token or progress note, and `done` or
`error`. A client that goes away ends the answer, and leaving `answer` cancels the runner's
work.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from aiohttp import web
from localllm.engine.runner.protocol import Done, Event, Failure, Progress, Token
from localllm.modelstore.store import ModelEntry

from localllm.errors import UserError
from localllm.options import LoadOptions

from localllm.modelstore.custom import Customization
from ..chat.errors import ContextOverflow
from ..chat.images import load_images
from ..chat.model import ChatModel, model_for
from ..chat.parse import Parsed
from ..chat.request import ChatRequest, Prepared, check_request_text, prepare_queued
from ..chat.truncate import fit_to_context
from localllm.engine.seam import Engine
from ..remote import RemoteEngine
from ..remote import prepared as upstream_prepared
from ..state import CONFIG, SCHEDULER
from .common import remember

log = logging.getLogger("localllm.daemon")


# ---- running a request ---------------------------------------------------------------------
@dataclass
class Generation:
    entry: ModelEntry
    runner: Engine | None  # the engine serving it (another runner after a retry); None before
    events: AsyncIterator[Event] | None
    load_duration_ns: int  # time spent loading for this request (0 when it was loaded)
    started_ns: int = field(default_factory=time.perf_counter_ns)

    def total_duration_ns(self) -> int:
        return time.perf_counter_ns() - self.started_ns


class GenerationFailed(UserError):
    """The runner answered with a Failure before anything was sent (status from the runner)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.status = failure.status


def failed(failure: Failure) -> UserError:
    """The error a Failure before anything was sent is answered with: a prompt the runner
    found too long for its context is an overflow, worded for each API's clients."""
    if len(failure.context_exceeded) == 2:
        tokens, n_ctx = failure.context_exceeded
        return ContextOverflow(failure.message, tokens, n_ctx, param=None)
    return GenerationFailed(failure)


async def first_event(gen: Generation) -> Event:
    """The first event of a streamed request: a Failure here still becomes an HTTP error
    status, because nothing has been sent yet."""
    event = await anext(gen.events)
    if isinstance(event, Failure):
        raise failed(event)
    return event


@contextlib.asynccontextmanager
async def hold(app: web.Application, entry: ModelEntry, load: LoadOptions,
               keep_alive="default", prompt_chars: int = 0,
               hint: str | None = None) -> AsyncIterator[Engine]:
    """The engine that answers for `entry`, held for one request: a remote model's upstream,
    or one slot of the local model's runner (loaded as need be: Scheduler.use)."""
    if entry.remote is not None:
        yield RemoteEngine(entry)
        return
    async with app[SCHEDULER].use(entry, load, keep_alive, prompt_chars, hint) as runner:
        yield runner


@contextlib.asynccontextmanager
async def generate(app: web.Application, entry: ModelEntry, request, load: LoadOptions,
                   keep_alive="default", fit=None, hint: str | None = None,
                   prompt_chars: int = 0) -> AsyncIterator[Generation]:
    """`fit(runner)`, when given, may replace the request once the runner is held (the chat
    layer drops old turns that do not fit the loaded context). `hint`: what the route says of
    the session, should this request load the model (profiles.traffic). The runner is held,
    and the model loaded, when the first event is read. `request`: what the model's engine takes
(a GenerationRequest for the runner; a remote model's, remote.UpstreamRequest)."""
    gen = Generation(entry, None, None, 0)
    started_wall = time.time()

    async def events() -> AsyncIterator[Event]:
        """The runner's events; a runner that dies before the answer's first token is loaded
        again and asked once more (the client sees a slower answer, not an error). After a
        token has gone out, its death ends the answer with the Failure."""
        retried = False
        while True:
            async with hold(app, entry, load, keep_alive, prompt_chars, hint) as runner:
                gen.runner = runner
                if runner.loaded_at >= started_wall:
                    gen.load_duration_ns += runner.load_duration_ns
                asked = await fit(runner) if fit is not None else request
                answered = False
                async with contextlib.aclosing(runner.generate(asked)) as inner:
                    async for event in inner:
                        if isinstance(event, Failure) and not runner.alive \
                                and not answered and not retried:
                            log.warning("the runner for %s died before answering (%s); "
                                        "loading it again for this request", entry.name,
                                        event.message)
                            break
                        answered = answered or isinstance(event, Token)
                        yield event
                    else:
                        return
            retried = True

    async with contextlib.aclosing(events()) as gen.events:
        yield gen


@dataclass
class Part:
    """Parsed text of one or more tokens, with the runner's event it came with."""
    parsed: Parsed
    event: Token | Done | Failure | Progress
    logprobs: list[dict] = field(default_factory=list)


@dataclass
class Answer:
    gen: Generation
    prepared: Prepared
    model: ChatModel | None  # None: a remote model (its upstream renders the template)
    first_token_ns: int = 0  # request received -> first token, load included (0: none yet)

    def truncation(self) -> dict:
        """A localllm addition to the last line: how many of the oldest messages were left
        out to fit the context, so that a client can say so (nothing when none were)."""
        dropped = self.prepared.dropped_messages
        return {"dropped_messages": dropped} if dropped else {}

    async def whole(self) -> tuple[Parsed, Done, list[dict]]:
        out, logprobs = Parsed(), []
        parser = None  # the prepared request's, once the runner is held (it may be cut to fit)
        async for event in self.gen.events:
            parser = parser or self.prepared.parser
            if isinstance(event, Token):
                self.first_token_ns = self.first_token_ns or self.gen.total_duration_ns()
                out.add(parser.feed(event.text))
                logprobs += event.logprobs or []
            elif isinstance(event, Failure):
                raise failed(event)
            elif isinstance(event, Done):
                out.add(parser.finish())
                return out, event, logprobs
        raise GenerationFailed(Failure("the runner ended the answer without finishing it"))

    async def parts(self) -> AsyncIterator[Part]:
        """Parts as they come; the first event is read before anything is sent, so a failure
        there can still be an HTTP error. The last part carries the Done (or a Failure)."""
        event = await first_event(self.gen)
        parser = self.prepared.parser  # as fitted to the runner's context, read once it is held
        while True:
            if isinstance(event, Token):
                parsed = parser.feed(event.text)
                if parsed or event.logprobs:
                    yield Part(parsed, event, list(event.logprobs or []))
            elif isinstance(event, Done):
                yield Part(parser.finish(), event)
                return
            elif isinstance(event, Failure):
                yield Part(Parsed(), event)
                return
            elif isinstance(event, Progress):  # a long prompt is being read
                yield Part(Parsed(), event)
            event = await anext(self.gen.events)


# The model as requests see it, by manifest digest and template: the manifest's layers (the
# GGUF, its projector, a Modelfile's template) never change under one digest.
_chat_models: dict[tuple[str, str | None], ChatModel] = {}


async def served_model(entry: ModelEntry, custom: Customization | None) -> ChatModel:
    """`model_for(entry, custom.template)`, worked out once per manifest and template (its
    projector check and a Modelfile template's style: chat/model.py caches per blob only)."""
    template = custom.template if custom is not None else None
    key = (entry.manifest_digest, template)
    found = _chat_models.get(key)
    if found is None:
        found = await model_for(entry, template)
        remember(_chat_models, key, found)
    return found


def with_messages(request: ChatRequest, messages: tuple[dict, ...]) -> ChatRequest:
    """A chat with a Modelfile's MESSAGE lines before its own (after its system messages), as
    Ollama sends them."""
    if not messages or request.messages is None:
        return request
    own = list(request.messages)
    first = next((i for i, m in enumerate(own) if m["role"] != "system"), len(own))
    return replace(request, messages=(*own[:first], *messages, *own[first:]))


def with_default_system(request: ChatRequest, system: str | None) -> ChatRequest:
    if not system:
        return request
    if request.messages is not None:
        if any(m["role"] == "system" for m in request.messages):
            return request
        return replace(request, messages=({"role": "system", "content": system},
                                          *request.messages))
    return request if request.system or request.raw else replace(request, system=system)


@contextlib.asynccontextmanager
async def answer(app: web.Application, entry: ModelEntry, request: ChatRequest,
                 keep_alive="default",
                 truncate: bool = True, cut_tokens: bool = False,
                 custom: Customization | None = None) -> AsyncIterator[Answer]:
    """Check and render the request (400s come from here, before the model loads), then run it.
    A chat longer than the context drops its oldest turns, or with `truncate` False is a 400.
    `custom` is what a Modelfile added: its template and its default system prompt."""
    check_request_text(request)
    if custom is not None:
        request = with_default_system(with_messages(request, custom.messages), custom.system)
    if entry.remote is not None:  # its upstream renders the template
        model, prepared = None, upstream_prepared(request)
    else:
        model = await served_model(entry, custom)
        if request.images and model.has_vision:  # (prepare refuses them for any other model)
            data = await load_images(request.images, app[CONFIG].image_urls == "on")
            request = replace(request, image_data=data)
        # Rendering runs the model's template (a worker process, up to its time limit): never
        # on the event loop, which serves everyone else meanwhile.
        prepared = await prepare_queued(model, request)

    run: Answer | None = None

    async def fit(runner: Engine):
        nonlocal prepared
        if not runner.n_ctx:  # an engine that keeps its context to itself (remote) cuts alone
            return prepared.generation
        if not prepared.fits_whole(runner.n_ctx):
            prepared = await fit_to_context(model, request, prepared, runner, truncate,
                                            cut_tokens)
        if run is not None:  # the answer reads what was sent: its parser, its dropped turns
            run.prepared = prepared
        return replace(prepared.generation, truncate=cut_tokens)

    hint = request.workload_hint or ("tools" if request.tools else None)
    async with generate(app, entry, prepared.generation, request.load, keep_alive,
                        fit=fit, hint=hint, prompt_chars=len(prepared.prompt)) as gen:
        run = Answer(gen, prepared, model)
        yield run


async def count_prompt_tokens(app: web.Application, entry: ModelEntry, request: ChatRequest,
                              custom: Customization | None = None) -> int:
    """Tokens the rendered prompt of `request` is, as the runner reads it (loads the model)."""
    check_request_text(request)
    if custom is not None:
        request = with_default_system(request, custom.system)
    if entry.remote is not None:
        prompt = ""  # (its engine says why it cannot count)
    else:
        model = await served_model(entry, custom)
        prompt = (await prepare_queued(model, request)).prompt  # the template's worker: waits
    async with hold(app, entry, request.load) as engine:
        return await engine.count_tokens(prompt)


# ---- the wire format -------------------------------------------------------------------------
SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Writer(ABC):
    """One wire format's answer. `whole` is the answer sent at once; a stream is `start`,
    then `part` for each Token or Progress, then `done` (the Done, with the text the parser
    held back until the end) or `error` (the runner failed, or this daemon did, after the
    headers went out). `response` and `run` are set before `start`."""

    headers: dict = SSE
    response: web.StreamResponse
    run: Answer

    @abstractmethod
    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        ...

    async def start(self, first: Part) -> None:  # noqa: B027 (a hook: most formats say nothing)
        """What the stream says before the first part (`first` is that part)."""

    @abstractmethod
    async def part(self, part: Part) -> None:
        ...

    @abstractmethod
    async def done(self, part: Part) -> None:
        ...

    @abstractmethod
    async def error(self, message: str) -> None:
        ...

    async def write(self, data: bytes) -> None:
        await self.response.write(data)

    # A writer whose answer may take more than one generation (a tool the server runs itself,
    # its result read by the model before it goes on) says so here: it returns the request to
    # run next, or None when the answer is complete.
    async def follow_up(self, parsed: Parsed, done: Done) -> ChatRequest | None:
        """After each generation of an answer sent whole (`parsed`: all of its text), before
        `whole`."""
        return None

    async def follow_up_stream(self, part: Part) -> ChatRequest | None:
        """After each generation of a streamed answer (`part`: its last part, with the Done),
        before `done`."""
        return None


async def respond(request: web.Request, chat: ChatRequest, writer: Writer, *,
                  entry: ModelEntry, custom: Customization, stream: bool,
                  keep_alive="default", truncate: bool = True,
                  cut_tokens: bool = False) -> web.StreamResponse:
    """Answer `chat` in `writer`'s wire format: one object (stream False) or a stream.
    `truncate`: a chat longer than the context drops its oldest turns (else a 400);
    `cut_tokens`: a prompt still too long loses its oldest tokens (Ollama's routes). A writer's
    follow-up request runs on the same model, its answer going on in the same response."""
    def run_of(asked: ChatRequest):
        return answer(request.app, entry, asked, keep_alive, truncate=truncate,
                      cut_tokens=cut_tokens, custom=custom)

    if not stream:
        asked: ChatRequest | None = chat
        while asked is not None:
            async with run_of(asked) as run:
                writer.run = run
                parsed, done, logprobs = await run.whole()
            asked = await writer.follow_up(parsed, done)
        return web.json_response(writer.whole(parsed, done, logprobs))
    async with run_of(chat) as run:
        writer.run = run
        parts = run.parts()
        part = await anext(parts)  # a failure here is still an HTTP error: nothing is sent yet
        response = writer.response = web.StreamResponse(headers=writer.headers)
        await response.prepare(request)
        try:
            await writer.start(part)
            await _stream(writer, part, parts, run_of)
        except ConnectionError:
            return response  # client went away: leaving `answer` cancels the runner
        except Exception as e:  # headers are sent: the client hears of it in the stream
            log.exception("error streaming %s", request.path)
            await writer.error(f"internal error: {e}")
        await response.write_eof()
        return response


async def _stream(writer: Writer, part: Part, parts: AsyncIterator[Part], run_of) -> None:
    """The parts of a streamed answer, into `writer`, through every follow-up generation."""
    while True:
        if isinstance(part.event, Done):
            asked = await writer.follow_up_stream(part)
            if asked is None:
                await writer.done(part)
                return
            async with run_of(asked) as run:
                writer.run = run
                more = run.parts()
                await _stream(writer, await anext(more), more, run_of)
            return
        if isinstance(part.event, Failure):
            await writer.error(part.event.message)
            return
        await writer.part(part)
        part = await anext(parts)
