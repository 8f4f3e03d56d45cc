"""One internal request for every API, and how it becomes a runner request.

The Ollama and OpenAI routes translate their JSON into a `ChatRequest`; `prepare` checks it
against what the model can do, renders the prompt (template with tools, or fill-in-the-middle),
compiles `format` / a forced tool into a grammar, and returns the `GenerationRequest` together
with the parser that splits the answer into content, thinking and tool calls.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from localllm.engine.runner.protocol import GenerationRequest

from localllm.options import LoadOptions, SamplingOptions

from .errors import ChatError
from .grammar import BadFormat, format_grammar, tool_call_grammar
from .images import place_images
from .model import ChatModel
from .parse import make_parser
from .roles import place_system_messages
from .template import HARMONY, THINK_TAGS, TemplateFailed, render, render_default

THINK_LEVELS = ("low", "medium", "high")


@dataclass(frozen=True)
class ChatRequest:
    id: str
    model_name: str
    options: SamplingOptions
    load: LoadOptions = LoadOptions()  # what the request asks of the loaded model
    messages: tuple[dict, ...] | None = None  # chat: HF-shaped (tool_calls, tool results)
    prompt: str | None = None  # generate / completions
    system: str | None = None
    suffix: str | None = None  # fill-in-the-middle: the text after the cursor
    raw: bool = False
    tools: tuple[dict, ...] = ()  # OpenAI-shaped {"type": "function", "function": {...}}
    tool_choice: str | dict = "auto"  # "auto", "none", "required" or {"name": ...}
    format: object = None  # None, "json" or a JSON schema
    think: bool | str | None = None
    has_images: bool = False
    images: tuple = ()  # ImageSource per images.slot(i) written in the text (chat/images.py)
    image_data: tuple[bytes, ...] = ()  # their bytes, loaded and checked by answer()
    logprobs: int | None = None
    echo: bool = False  # completions: the answer starts with the prompt (with its logprobs)
    # What the route says of the session, for a model's first load before the daemon has seen
    # what it is asked (profiles.traffic): agents' routes name themselves.
    workload_hint: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass
class Prepared:
    generation: GenerationRequest
    parser: object  # OutputParser or HarmonyParser: feed(text) / finish() -> Parsed
    prompt: str
    dropped_messages: int = 0  # oldest messages left out to fit the context (truncate.py)

    def fits_whole(self, n_ctx: int) -> bool:
        """Whether the prompt fits a context of `n_ctx` tokens as it is, known without
        tokenizing it: no token is shorter than a byte, a BOS may be added, and one token is
        left for the answer. Only a prompt that may not fit goes to truncate.py."""
        return len(self.prompt.encode()) + 1 <= n_ctx - 1


MAX_REQUEST_TEXT_BYTES = 8 << 20


def turn_text(turn: list[dict]) -> str:
    """What a turn puts into the prompt besides the template's markers (for counting)."""
    parts = []
    for m in turn:
        content = m.get("content")
        parts.append(content if isinstance(content, str) else json.dumps(content))
        if m.get("tool_calls"):
            parts.append(json.dumps(m["tool_calls"]))
    return "\n".join(parts)


def request_text_bytes(request: ChatRequest) -> int:
    """The text a request brings (its messages or prompt), in UTF-8 bytes."""
    if request.messages is None:
        return sum(len((t or "").encode()) for t in (request.prompt, request.system,
                                                     request.suffix))
    return sum(len(turn_text([m]).encode()) for m in request.messages)


def check_request_text(request: ChatRequest) -> None:
    """A request's text is capped far past any context (8 MiB): a 400 before anything reads it."""
    size = request_text_bytes(request)
    if size > MAX_REQUEST_TEXT_BYTES:
        raise ChatError(f"the request's text is {size / (1 << 20):.1f} MiB, more than the "
                        f"{MAX_REQUEST_TEXT_BYTES >> 20} MiB a request may carry (far past any "
                        f"context); send only the part the model should read",
                        "prompt" if request.messages is None else "messages")


def _check(model: ChatModel, request: ChatRequest) -> None:
    name = request.model_name
    if (request.has_images or request.images) and not model.has_vision:
        raise ChatError(f"{name} does not support images (it has no vision projector)",
                        "images")
    if request.suffix and model.fim is None:
        raise ChatError(f"{name} does not support insert", "suffix")
    if request.tools and request.tool_choice != "none" and not model.style.tools:
        raise ChatError(f"{name} does not support tools", "tools")
    think = request.think
    if think is not None and not isinstance(think, bool) and think not in THINK_LEVELS:
        raise ChatError('think must be true, false, "low", "medium" or "high"', "think")
    if think not in (None, False) and not model.style.thinking:
        raise ChatError(f'"{name}" does not support thinking', "think")


def _forced_tools(request: ChatRequest) -> list[dict] | None:
    """The tools a call must come from when the request forces one, else None."""
    choice = request.tool_choice
    if not request.tools or choice in ("auto", "none"):
        return None
    if choice == "required":
        return list(request.tools)
    wanted = choice.get("name") if isinstance(choice, dict) else None
    chosen = [t for t in request.tools if (t.get("function") or {}).get("name") == wanted]
    if not chosen:
        raise ChatError(f"tool_choice names {wanted!r}, which is not among the tools",
                        "tool_choice")
    return chosen


def prepare(model: ChatModel, request: ChatRequest) -> Prepared:
    _check(model, request)
    tools = list(request.tools) if request.tool_choice != "none" else []
    think = request.think
    if think is None and model.style.thinking:
        think = True  # Ollama: thinking models think unless told not to
    if request.format not in (None, "") and model.style.thinking == THINK_TAGS:
        think = False  # the grammar would forbid the <think> block
    if request.suffix is not None and model.fim is not None and request.prompt is not None:
        fim = model.fim
        prompt = f"{fim.prefix}{request.prompt}{fim.suffix}{request.suffix}{fim.middle}"
    elif request.messages is not None:
        prompt = _render(model, list(request.messages), tools, think)
    elif request.raw or model.template is None:
        prompt = request.prompt or ""
        if request.system and not request.raw:
            prompt = f"{request.system}\n\n{prompt}"
    else:
        messages = [{"role": "system", "content": request.system}] if request.system else []
        messages.append({"role": "user", "content": request.prompt or ""})
        prompt = _render(model, messages, tools, think)
    forced = _forced_tools(request)
    grammar = None  # free text: neither a forced call nor a `format` (None or "")
    try:
        if forced:
            grammar = tool_call_grammar(forced, model.style.tool_format)
        elif request.format not in (None, ""):
            grammar = format_grammar(request.format)
    except BadFormat as e:
        raise ChatError(str(e), "format") from None
    if forced and model.style.tool_format == HARMONY:
        grammar = None  # harmony calls pass through control tokens a grammar cannot name
    images = ()
    if request.image_data:
        prompt, images = place_images(prompt, request.image_data)
    generation = GenerationRequest(id=request.id, prompt=prompt,
                                   options=request.options, grammar=grammar,
                                   logprobs=request.logprobs, images=images,
                                   prompt_logprobs=request.echo and request.logprobs is not None)
    in_thinking = model.style.thinking == THINK_TAGS and prompt.rstrip().endswith("<think>")
    parser = make_parser(model.style.tool_format, model.style.thinking, tools=bool(tools),
                         in_thinking=in_thinking and think is not False,
                         keep_thinking=think is not False)
    if forced and model.style.thinking == THINK_TAGS:
        parser.mode = "content"  # the grammar starts the answer with the call
    return Prepared(generation, parser, prompt)


def _render(model: ChatModel, messages: list[dict], tools: list[dict],
            think: bool | str | None) -> str:
    if model.template is None:  # a base model: Ollama's default template, as Ollama does
        return render_default(messages)
    if any(m["role"] == "system" for m in messages[1:]):  # a system message after other turns
        messages = place_system_messages(messages, model.template, model.bos, model.eos)
    try:
        return render(model.template, messages, tools=tools or None, bos=model.bos,
                      eos=model.eos, think=think if model.style.thinking else None)
    except TemplateFailed as e:
        raise ChatError(str(e), "messages") from None


# ---- where templates render ------------------------------------------------------------------
# A few threads per model, so that one model's templates queue behind each other and never in
# front of another model's requests. A template is code from whoever made the model or wrote
# its Modelfile; one that runs to its time limit (2 s) on every request, asked 24 times at once,
# holds its own model's renders for a while, and every other model's chats render at once on
# their own threads.
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
