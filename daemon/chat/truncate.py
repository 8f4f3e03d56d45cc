"""A chat longer than the context: keep the system prompt and the latest turns, drop the oldest
(what Ollama does), or refuse with a 400 when the request says `truncate: false`."""

from __future__ import annotations

from dataclasses import replace

from .model import ChatModel
from .request import ChatError, ChatRequest, Prepared, prepare


def room_for_prompt(n_ctx: int, num_predict: int) -> int:
    """Prompt tokens that still leave the answer room: what it asked for, at most half."""
    answer = min(num_predict, n_ctx // 2) if num_predict > 0 else min(256, n_ctx // 4)
    return n_ctx - max(answer, 1)


def drop_oldest_turn(messages: list[dict]) -> list[dict] | None:
    """Without the oldest turn after the system messages: from the first non-system message up
    to the next user message. None when only the latest message is left to drop."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
    if first is None or first >= len(messages) - 1:
        return None
    end = first + 1
    while end < len(messages) - 1 and messages[end]["role"] != "user":
        end += 1
    return messages[:first] + messages[end:]


async def fit_to_context(model: ChatModel, request: ChatRequest, prepared: Prepared, runner,
                         truncate: bool) -> Prepared:
    """`prepared`, or the same request with its oldest turns dropped until the prompt fits.
    A plain prompt (generate, completions) that is too long gets the runner's own 400."""
    limit = room_for_prompt(runner.n_ctx, request.options.num_predict)
    if request.messages is None or len(prepared.prompt.encode()) + 1 <= limit:
        return prepared  # no token is shorter than a byte: it fits without asking the runner
    count = await runner.count_tokens(prepared.prompt)
    if count <= limit:
        return prepared
    if not truncate:
        raise ChatError(f"the prompt is {count} tokens but the context is {runner.n_ctx}; "
                        f"shorten the conversation, load the model with a larger num_ctx, or "
                        f"leave truncate on to drop the oldest turns", "messages")
    messages = list(request.messages)
    while (messages := drop_oldest_turn(messages)) is not None:
        try:
            candidate = prepare(model, replace(request, messages=tuple(messages)))
        except ChatError:
            continue  # some templates refuse a history that starts mid-conversation
        count = await runner.count_tokens(candidate.prompt)
        if count <= limit:
            return candidate
    raise ChatError(f"the system prompt and the last message alone are {count} tokens, more "
                    f"than the context of {runner.n_ctx} leaves room for; shorten them or load "
                    f"the model with a larger num_ctx", "messages")
