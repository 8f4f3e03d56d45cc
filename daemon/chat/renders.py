"""Where chat templates render: a few threads per model, so that one model's templates queue
behind each other and never in front of another model's requests. A template is code from
whoever made the model or wrote its Modelfile; one that runs to its time limit (2 s) on every
request, asked 24 times at once, holds its own model's renders for a while, and every other
model's chats render at once on their own threads.

    prepared = await prepare_queued(model, request)   # chat/request.prepare, off the loop
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from .model import ChatModel
from .request import ChatRequest, Prepared, prepare

RENDERS_PER_MODEL = 2  # a model's renders at once; its other requests wait their turn
MAX_POOLS = 64  # models with threads kept; the least recently used one's are let go past it

_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _pool(model_name: str) -> ThreadPoolExecutor:
    with _lock:
        pool = _pools.pop(model_name, None)
        if pool is None:
            pool = ThreadPoolExecutor(RENDERS_PER_MODEL, f"render-{model_name[:24]}")
        _pools[model_name] = pool  # the most recently used last
        while len(_pools) > MAX_POOLS:
            _pools.pop(next(iter(_pools))).shutdown(wait=False)
        return pool


async def prepare_queued(model: ChatModel, request: ChatRequest) -> Prepared:
    """`prepare(model, request)` on the threads of the request's model."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(request.model_name), prepare, model, request)
