"""POST /v1/responses/compact: OpenAI's compaction endpoint, as Codex calls it.

The body is a Responses request (`model`, `input`, `instructions`, `tools`...). The model
summarises the conversation on the prompt it has cached (chat/compaction.py: the instruction is
appended as a user turn, nothing before it is read again), and the answer is a
`response.compaction` object whose `output` is the conversation's user messages followed by a
`compaction` item holding the summary, which the client sends back in place of the rest. Its
usage is the summarising turn's, cached tokens included.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from ..chat.compaction import summarising
from .common import read_json
from .respond import answer
from .responses import compaction_item, read_turn, usage

routes = web.RouteTableDef()


def user_messages(body: dict) -> list[dict]:
    """The input's user messages, kept as they came (as OpenAI's compaction keeps them)."""
    items = body.get("input")
    if isinstance(items, str):
        return [{"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": items}]}]
    return [item for item in items or () if isinstance(item, dict)
            and item.get("type", "message") == "message" and item.get("role") == "user"]


@routes.post("/v1/responses/compact")
async def compact(request: web.Request) -> web.Response:
    body = await read_json(request)
    turn = await read_turn(request, {**body, "stream": False, "store": False})
    async with answer(request.app, turn.entry, summarising(turn.chat),
                      truncate=body.get("truncation") != "disabled",
                      custom=turn.custom) as run:
        parsed, done, _ = await run.whole()
    return web.json_response({
        "id": f"resp_{uuid.uuid4().hex[:24]}", "object": "response.compaction",
        "created_at": int(time.time()),
        "output": [*user_messages(body), compaction_item(parsed)], "usage": usage(done)})
