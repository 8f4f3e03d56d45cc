"""A chat longer than the context: keep the system prompt and the latest turns, drop the oldest
(what Ollama does), or refuse with a 400 when the request says `truncate: false`.

Each turn's tokens are counted once (one runner round trip for all of them); the turns that fit
are chosen from those counts, and the chosen prompt is rendered and measured to confirm. A long
chat costs a few renders, not one render and tokenization of the whole prompt per dropped turn
(1,001 turns used to take minutes before the first token).

llama.cpp's tokenizer is quadratic in the special tokens of its text (a rendered chat has a few
per message: 20,000 turns, 2 MB, took minutes on the runner's only thread). So no text is
tokenized that cannot fit for sure: a prompt past BYTES_PER_TOKEN bytes per token of room first
keeps only as many of its newest turns as could fit by size, and a plain prompt that long is a
400 without being read. (A request's text is capped at MAX_REQUEST_TEXT_BYTES: request.py.)
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from .model import ChatModel
from .errors import ChatError, ContextOverflow
from .request import ChatRequest, Prepared, prepare_queued, turn_text

log = logging.getLogger("localllm.chat")

# More bytes than any real text averages per token (prose is about 4; the longest tokens, runs
# of spaces, reach about 80 on their own): a text of more than this per token of room cannot fit.
BYTES_PER_TOKEN = 32


def room_for_prompt(n_ctx: int, num_predict: int) -> int:
    """Prompt tokens a chat that must lose turns is cut to: room for the answer it asked for,
    at most a quarter of the context (256 tokens where it set no limit). A prompt that fits the
    context whole is never cut: `num_predict` (max_tokens) is a ceiling, not a reservation, and
    the answer stops at the context's end with done_reason "length"."""
    answer = min(num_predict if num_predict > 0 else 256, n_ctx // 4)
    return n_ctx - max(answer, 1)


def whole_context(n_ctx: int) -> int:
    """The longest prompt the runner reads: one token of the context is left for the answer."""
    return n_ctx - 1


def too_long(count: int, n_ctx: int, trained: int,
             what: str = "the prompt is") -> ContextOverflow:
    """The 400 for a prompt the context cannot hold: its size, the context's, what to do."""
    if trained > n_ctx:
        bigger = (f"load the model with a larger num_ctx (it was trained on {trained} "
                  f"tokens)")
    else:
        bigger = (f"use a model with a longer context ({n_ctx} tokens is all this one was "
                  f"trained on)" if trained else "load the model with a larger num_ctx")
    return ContextOverflow(f"{what} {count} tokens but the loaded context holds {n_ctx}; "
                           f"shorten the conversation (an agent: compact it or start a new "
                           f"one), or {bigger}", count, n_ctx)


def bytes_too_long(size: int, n_ctx: int, advice: str, param: str) -> ContextOverflow:
    """The 400 for a prompt refused by its bytes alone (never tokenized: it cannot fit). Its
    tokens are at least its bytes over BYTES_PER_TOKEN, and more than the context holds."""
    return ContextOverflow(f"the prompt is {size} bytes, more than a context of {n_ctx} tokens "
                           f"can hold; {advice}", max(size // BYTES_PER_TOKEN, n_ctx + 1),
                           n_ctx, param)


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


def split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(the leading system messages, the turns after them): a turn runs from a message to just
    before the next user message, so a question travels with its calls and their results."""
    first = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    turns: list[list[dict]] = []
    for message in messages[first:]:
        if not turns or message["role"] == "user":
            turns.append([])
        turns[-1].append(message)
    return messages[:first], turns


def first_kept(costs: list[float], budget: float) -> int:
    """The index of the oldest turn to keep so that it and every newer one fit `budget`; the
    newest turn is kept even when it alone does not."""
    total, start = 0.0, len(costs)
    while start > 0 and total + costs[start - 1] <= budget:
        total += costs[start - 1]
        start -= 1
    return min(start, len(costs) - 1)


async def _keep_what_could_fit(model: ChatModel, request: ChatRequest,
                               budget: int) -> tuple[ChatRequest, Prepared]:
    """The request with only its newest turns whose text is within `budget` bytes (what is
    older could not fit whatever it tokenizes to), rendered."""
    head, turns = split_turns(list(request.messages))
    sizes = [len(turn_text(t).encode()) for t in turns]
    oldest = first_kept(sizes, budget - len(turn_text(head).encode()))
    for start in range(oldest, len(turns)):  # a template may refuse to start mid-conversation
        cut = replace(request, messages=(*head, *(m for t in turns[start:] for m in t)))
        try:
            return cut, await prepare_queued(model, cut)
        except ChatError:
            continue
    raise ChatError("the conversation's last turn alone is longer than the context can hold; "
                    "shorten it or load the model with a larger num_ctx", "messages")


async def fit_to_context(model: ChatModel, request: ChatRequest, prepared: Prepared, runner,
                         truncate: bool, cut_tokens: bool = False) -> Prepared:
    """`prepared`, or the same request with its oldest turns dropped until the prompt fits.
    A plain prompt (generate, completions) that is too long gets the runner's own 400, unless
    the runner cuts its oldest tokens (`cut_tokens`, Ollama's truncate): then a prompt too big
    to tokenize is first cut to its newest bytes, and a chat whose last message alone does not
    fit is sent for the runner to cut."""
    whole = whole_context(runner.n_ctx)
    limit = room_for_prompt(runner.n_ctx, request.options.num_predict)
    size = len(prepared.prompt.encode())
    if request.messages is None and cut_tokens and size > runner.n_ctx * BYTES_PER_TOKEN:
        newest = prepared.prompt.encode()[-runner.n_ctx * BYTES_PER_TOKEN:]
        log.info("the prompt is %d bytes: its newest %d kept for the runner to cut to the "
                 "context", size, len(newest))
        return replace(prepared, prompt=newest.decode("utf-8", errors="ignore"),
                       generation=replace(prepared.generation,
                                          prompt=newest.decode("utf-8", errors="ignore")))
    if request.messages is None and size > runner.n_ctx * BYTES_PER_TOKEN:
        raise bytes_too_long(size, runner.n_ctx, "shorten it, or load the model with a "
                             "larger num_ctx", "prompt")
    if request.messages is None or prepared.fits_whole(runner.n_ctx):
        return prepared
    if size > whole * BYTES_PER_TOKEN:  # bound the text before tokenizing it (quadratic)
        if not truncate:
            raise bytes_too_long(size, runner.n_ctx, "shorten the conversation, load the "
                                 "model with a larger num_ctx, or leave truncate on to drop "
                                 "the oldest turns", "messages")
        request, prepared = await _keep_what_could_fit(model, request, limit * BYTES_PER_TOKEN)
    count = await runner.count_tokens(prepared.prompt)
    if count <= whole:
        return prepared
    if not truncate:
        raise too_long(count, runner.n_ctx, model.context_length)
    started, renders = time.monotonic(), 0
    head, turns = split_turns(list(request.messages))
    head_count, *counted = await runner.count_tokens_each(
        [turn_text(head), *(turn_text(t) for t in turns)])
    # What the template adds around the turns' text, spread over them: the whole prompt's
    # count less the text's own (the template's fixed parts are in it too).
    overhead = max(0.0, (count - head_count - sum(counted)) / max(len(turns), 1))
    costs = [c + overhead for c in counted]
    start = first_kept(costs, limit - head_count)
    fallback: Prepared | None = None
    while True:
        kept = [*head, *(m for turn in turns[start:] for m in turn)]
        if start >= len(turns):  # the newest turn alone is too long: its last message only
            kept = [*head, request.messages[-1]]
        renders += 1
        try:
            candidate = await prepare_queued(model, replace(request, messages=tuple(kept)))
        except ChatError:
            candidate = None  # some templates refuse a history that starts mid-conversation
        if candidate is not None:
            count = await runner.count_tokens(candidate.prompt)
            if count <= whole and fallback is None:
                fallback = candidate  # the most turns that fit, leaving less room than asked
            if count <= limit:
                log.info("dropped the oldest %d of %d turns to fit %d prompt tokens "
                         "(%d renders, %.0f ms)", start, len(turns), limit, renders,
                         (time.monotonic() - started) * 1000)
                return replace(candidate,
                               dropped_messages=len(request.messages) - len(kept))
        if start >= len(turns):
            if fallback is not None:
                return fallback
            break
        # Over by `excess`: drop as many more of the oldest kept turns as cover it (one at
        # least), so a few renders settle even when the estimate was off.
        excess = count - limit if candidate is not None else 0
        freed = 0.0
        while start < len(turns) and (freed < excess or freed == 0):
            freed += costs[start]
            start += 1
    if cut_tokens and candidate is not None:
        return replace(candidate, dropped_messages=len(request.messages) - len(kept))
    raise too_long(count, runner.n_ctx, model.context_length,
                   "the system prompt, tools and last message alone are")
