"""Run a `ChatRequest` and read its answer as parsed parts: what both API families share.

A route builds the ChatRequest, opens `answer(...)`, and either takes `whole()` or iterates
`parts()`; it only turns the parts into its own wire format.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from aiohttp import web
from localllm.modelstore.gguf_header import GGUFError
from localllm.modelstore.store import PROJECTOR_LAYER, DamagedModel, ModelEntry

from ..generation import Generation, GenerationFailed, first_event, generate, hold
from ..runner.protocol import Done, Failure, Progress, Token
from .custom import Customization, customized
from .model import ChatModel, chat_model
from .parse import Parsed
from .request import ChatRequest, Prepared, prepare
from .truncate import check_request_text, fit_to_context


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
    model: ChatModel
    first_token_ns: int = 0  # request received -> first token, load included (0: none yet)

    def truncation(self) -> dict:
        """A localllm addition to the last line: how many of the oldest messages were left
        out to fit the context, so that a client can say so (nothing when none were)."""
        dropped = self.prepared.dropped_messages
        return {"dropped_messages": dropped} if dropped else {}

    async def whole(self) -> tuple[Parsed, Done, list[dict]]:
        parser = self.prepared.parser
        out, logprobs = Parsed(), []
        async for event in self.gen.events:
            if isinstance(event, Token):
                self.first_token_ns = self.first_token_ns or self.gen.total_duration_ns()
                out.add(parser.feed(event.text))
                logprobs += event.logprobs or []
            elif isinstance(event, Failure):
                raise GenerationFailed(event)
            elif isinstance(event, Done):
                out.add(parser.finish())
                return out, event, logprobs
        raise GenerationFailed(Failure("the runner ended the answer without finishing it"))

    async def parts(self) -> AsyncIterator[Part]:
        """Parts as they come; the first event is read before anything is sent, so a failure
        there can still be an HTTP error. The last part carries the Done (or a Failure)."""
        parser = self.prepared.parser
        event = await first_event(self.gen)
        while True:
            if isinstance(event, Token):
                parsed = parser.feed(event.text)
                if parsed or event.logprobs:
                    yield Part(parsed, event, list(event.logprobs or []))
            elif isinstance(event, Done):
                yield Part(parser.finish(), event)
                return
            elif isinstance(event, (Failure,)):
                yield Part(Parsed(), event)
                return
            elif isinstance(event, Progress):  # a long prompt is being read
                yield Part(Parsed(), event)
            event = await anext(self.gen.events)


def with_default_system(request: ChatRequest, system: str | None) -> ChatRequest:
    if not system:
        return request
    if request.messages is not None:
        if any(m["role"] == "system" for m in request.messages):
            return request
        return replace(request, messages=({"role": "system", "content": system},
                                          *request.messages))
    return request if request.system or request.raw else replace(request, system=system)


async def model_for(entry: ModelEntry, custom: Customization | None = None) -> ChatModel:
    """The model as the chat layer sees it: with a Modelfile's template when `custom` has one;
    it takes images only when stored with a vision projector (the manifest's projector layer)."""
    try:
        model = await chat_model(entry.digest, entry.model_path)
    except (GGUFError, OSError) as e:
        raise DamagedModel(entry.name, str(e).replace(str(entry.model_path), "its blob")) \
            from None
    model = replace(model, has_vision=entry.companion(PROJECTOR_LAYER) is not None)
    return customized(model, custom) if custom is not None else model


@contextlib.asynccontextmanager
async def answer(app: web.Application, entry: ModelEntry, request: ChatRequest,
                 keep_alive="default",
                 truncate: bool = True,
                 custom: Customization | None = None) -> AsyncIterator[Answer]:
    """Check and render the request (400s come from here, before the model loads), then run it.
    A chat longer than the context drops its oldest turns, or with `truncate` False is a 400.
    `custom` is what a Modelfile added: its template and its default system prompt."""
    check_request_text(request)
    model = await model_for(entry, custom)
    if custom is not None:
        request = with_default_system(request, custom.system)
    if request.images and model.has_vision:  # (prepare refuses them for any other model)
        from ..state import CONFIG
        from .images import load_images

        data = await load_images(request.images, app[CONFIG].image_urls == "on")
        request = replace(request, image_data=data)
    # Rendering runs the model's template (a worker process, up to its time limit): never on
    # the event loop, which serves everyone else meanwhile.
    prepared = await asyncio.to_thread(prepare, model, request)

    async def fit(runner):
        nonlocal prepared
        prepared = await fit_to_context(model, request, prepared, runner, truncate)
        return prepared.generation

    hint = request.workload_hint or ("tools" if request.tools else None)
    async with generate(app, entry, prepared.generation, request.load, keep_alive,
                        fit=fit, hint=hint) as gen:
        yield Answer(gen, prepared, model)


async def count_prompt_tokens(app: web.Application, entry: ModelEntry, request: ChatRequest,
                              custom: Customization | None = None) -> int:
    """Tokens the rendered prompt of `request` is, as the runner reads it (loads the model)."""
    check_request_text(request)
    model = await model_for(entry, custom)
    if custom is not None:
        request = with_default_system(request, custom.system)
    prepared = await asyncio.to_thread(prepare, model, request)  # the template's worker: waits
    async with hold(app, entry, request.load) as runner:
        return await runner.count_tokens(prepared.prompt)
