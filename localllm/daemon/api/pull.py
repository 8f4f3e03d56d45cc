"""POST /api/pull: Ollama's pull, streaming its progress objects as NDJSON.

Request: {"model": NAME (or "name"), "stream": true}. NAME is a catalog name,
hf.co/OWNER/REPO:QUANT, hf.co/OWNER/REPO/FILE.gguf or a https URL. Stream: {"status":
"pulling manifest"}, then per blob {"status": "pulling <hex>", "digest", "total", "completed"},
then "verifying sha256 digest", "writing manifest", "success". With stream:false the answer
is {"status": "success"}.

Errors found before any byte is downloaded (unknown name, 404, 401, no disk space) answer with
a 4xx status and {"error": ...}; progress is held back until then so they can, but never past
MANIFEST_GRACE_S: a host that does not answer still gets "pulling manifest" on the wire at
once, and its error as the last line. An error after
the stream has begun arrives as a final {"error": ...} line, as Ollama sends it. A client that
goes away cancels the pull; its partial download stays and the next pull resumes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from aiohttp import web

from localllm.modelstore.download import PullError
from localllm.modelstore.hub import HubSettings
from localllm.modelstore.pull import plan_pull, pull_model

from ..state import CONFIG, STORE
from .common import ApiError, get_bool, get_model_field, read_json
from .ollama import NDJSON

routes = web.RouteTableDef()
_DONE = object()
MANIFEST_GRACE_S = 1.0


def _api_error(error: PullError) -> ApiError:
    return ApiError(error.status, str(error))


@routes.post("/api/pull")
async def api_pull(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    name = get_model_field(body)
    stream = get_bool(body, "stream", True)
    plan_pull(name)  # an unknown or malformed name fails here, as a 4xx
    store = request.app[STORE]
    config = request.app.get(CONFIG)
    hub = HubSettings.from_environment(config.hf_endpoint if config else None)

    events: asyncio.Queue = asyncio.Queue()
    task = asyncio.create_task(pull_model(store, name, events.put_nowait, hub=hub))
    task.add_done_callback(lambda _: events.put_nowait(_DONE))
    if not stream:
        try:
            await task
        except PullError as e:
            raise _api_error(e) from None
        return web.json_response({"status": "success"})

    response: web.StreamResponse | None = None
    held: list[dict] = []
    grace_ends = asyncio.get_running_loop().time() + MANIFEST_GRACE_S
    try:
        while (event := await _next(events, response is None and grace_ends)) is not _DONE:
            if event is None:  # the grace is over: say what is happening meanwhile
                response = await _start(request)
                for early in held:
                    await _write(response, early)
                continue
            if response is None and "completed" not in event:
                held.append(event)  # not yet: a resolution error may still become a 4xx
                continue
            if response is None:
                response = await _start(request)
                for early in held:
                    await _write(response, early)
            await _write(response, event)
        error = task.exception()
        if response is None:
            if isinstance(error, PullError):
                raise _api_error(error)
            if error is not None:
                raise error
            response = await _start(request)
            for early in held:
                await _write(response, early)
        elif error is not None:
            message = str(error) if isinstance(error, PullError) else f"pull failed: {error!r}"
            await _write(response, {"error": message})
        await response.write_eof()
        return response
    finally:
        if not task.done():  # the client went away (or the server is stopping)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


async def _next(events: asyncio.Queue, until: float | bool):
    """The next event; None when `until` (a loop time) passes first."""
    if not until:
        return await events.get()
    try:
        return await asyncio.wait_for(events.get(),
                                      max(0.0, until - asyncio.get_running_loop().time()))
    except TimeoutError:
        return None


async def _start(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": NDJSON})
    await response.prepare(request)
    return response


async def _write(response: web.StreamResponse, event: dict) -> None:
    await response.write(json.dumps(event).encode() + b"\n")


@routes.post("/api/push")
async def api_push(request: web.Request) -> web.Response:
    """Ollama's push to its registry: localllm has no registry to push to; said in a sentence
    rather than a bare 404 (a client's `push` then tells its user why)."""
    raise ApiError(400, "push is not supported: localllm has no model registry; share a model "
                   "by its GGUF file and `localllm show NAME --modelfile` (Hugging Face hosts "
                   "GGUFs that `localllm pull hf.co/OWNER/REPO` fetches)")
