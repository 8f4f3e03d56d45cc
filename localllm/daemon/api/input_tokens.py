"""How many tokens a request's prompt is, before it is sent: POST /v1/responses/input_tokens
(OpenAI's name and answer) and POST /v1/chat/completions/input_tokens (the same answer for a
chat completions body; OpenAI has none). The body is the request itself; the prompt is rendered
with the model's template and counted with its tokenizer, as /v1/messages/count_tokens does.
`localllm launch` sizes an agent's context with them."""

from __future__ import annotations

from aiohttp import web

from .common import read_json
from .openai import read_chat
from .respond import count_prompt_tokens
from .responses import read_turn

routes = web.RouteTableDef()


def _answer(tokens: int) -> web.Response:
    return web.json_response({"object": "response.input_tokens", "input_tokens": tokens})


@routes.post("/v1/responses/input_tokens")
async def responses_input_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    turn = await read_turn(request, {**body, "stream": False, "store": False})
    return _answer(await count_prompt_tokens(request.app, turn.entry, turn.chat, turn.custom))


@routes.post("/v1/chat/completions/input_tokens")
async def chat_input_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    entry, custom, chat = await read_chat(request, {**body, "stream": False})
    # (a remote model: its engine refuses to count, as on every counting route)
    return _answer(await count_prompt_tokens(request.app, entry, chat, custom))
