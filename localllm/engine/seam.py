"""The engine seam: what the response pipeline asks of whatever answers for a model.

Two kinds of engine answer: the local runner process (`local.py`'s RunnerProcess,
llama.cpp in a child process, one per loaded model, held through the scheduler's slots) and a
remote model's upstream (daemon/remote.py's RemoteEngine, an OpenAI-compatible server). The
pipeline (daemon/api/respond.py) and the routes see only this protocol, so every route serves
both: a route parses its wire format, the chat layer prepares the request the engine takes,
and the engine's typed events (`Token`, `Progress`, `Done`, `Failure`) come back to the
route's writer.

The pipeline's `hold` (daemon/api/respond.py) picks the kind from the stored entry: a remote model's
engine is ready at once (its upstream loads and schedules for itself), a local one is loaded
and one of its slots held by the scheduler.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from localllm.engine.runner.protocol import Embeddings, EmbedRequest, Event


class Engine(Protocol):
    """One model that answers requests. Each kind takes the request its preparation makes (a
    rendered prompt for the runner, the upstream's OpenAI request for a remote model)."""

    model_name: str
    n_ctx: int  # the context a request may fill, in tokens; 0: the engine does not say
    loaded_at: float  # wall clock of the load (0.0: never loaded here)
    load_duration_ns: int

    @property
    def alive(self) -> bool:
        """Whether requests can still be sent (false: load it again)."""
        ...

    async def start(self, timeout: float | None = None) -> None:
        """Load the model; an error that says why when it cannot."""
        ...

    def generate(self, request) -> AsyncIterator[Event]:
        """The events of one answer, ending in a Done or a Failure; leaving early cancels it."""
        ...

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """A unit vector per input (/api/embed, /v1/embeddings)."""
        ...

    async def count_tokens(self, text: str) -> int:
        ...

    async def count_tokens_each(self, texts: list[str]) -> list[int]:
        ...

    async def stop(self) -> None:
        ...

    def figures(self) -> dict:
        """What it has done since its load, for /api/stats: loaded_at, load_duration,
        context_length, tokens_generated."""
        ...
