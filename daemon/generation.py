"""One generation, whichever API asked for it: find the model, hold its runner, stream events.

Both API families call `generate()` and only translate its events into their wire format.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web
from localllm.errors import UserError
from localllm.modelstore.store import ModelEntry
from localllm.options import LoadOptions

from .runner.protocol import Event, Failure, GenerationRequest
from .runner.process import RunnerProcess
from .state import SCHEDULER, STORE


@dataclass
class Generation:
    entry: ModelEntry
    runner: RunnerProcess
    events: AsyncIterator[Event]
    load_duration_ns: int  # time spent loading for this request (0 when it was loaded)
    started_ns: int = field(default_factory=time.perf_counter_ns)

    def total_duration_ns(self) -> int:
        return time.perf_counter_ns() - self.started_ns


class GenerationFailed(UserError):
    """The runner answered with a Failure before anything was sent (status from the runner)."""

    def __init__(self, failure: Failure):
        super().__init__(failure.message)
        self.status = failure.status



async def first_event(gen: Generation) -> Event:
    """The first event of a streamed request: a Failure here still becomes an HTTP error
    status, because nothing has been sent yet."""
    event = await anext(gen.events)
    if isinstance(event, Failure):
        raise GenerationFailed(event)
    return event


def find_model(app: web.Application, name: str) -> ModelEntry:
    """The stored model for a request's `model` field (ModelNotFound -> 404 in the middleware)."""
    return app[STORE].get(name)


@contextlib.asynccontextmanager
async def generate(app: web.Application, entry: ModelEntry, request: GenerationRequest,
                   load: LoadOptions, keep_alive="default", fit=None,
                   hint: str | None = None) -> AsyncIterator[Generation]:
    """`fit(runner)`, when given, may replace the request once the runner is held (the chat
    layer drops old turns that do not fit the loaded context). `hint`: what the route says of
    the session, should this request load the model (profiles.traffic)."""
    started, started_wall = time.perf_counter_ns(), time.time()
    async with app[SCHEDULER].use(entry, load, keep_alive, len(request.prompt),
                                  hint) as runner:
        load_ns = runner.load_duration_ns if runner.loaded_at >= started_wall else 0
        if fit is not None:
            request = await fit(runner)
        async with contextlib.aclosing(runner.generate(request)) as events:
            yield Generation(entry, runner, events, load_ns, started)


@contextlib.asynccontextmanager
async def hold(app: web.Application, entry: ModelEntry, load: LoadOptions,
               keep_alive="default") -> AsyncIterator[RunnerProcess]:
    """Load (or keep) the model without generating: Ollama's empty-prompt request."""
    async with app[SCHEDULER].use(entry, load, keep_alive) as runner:
        yield runner
