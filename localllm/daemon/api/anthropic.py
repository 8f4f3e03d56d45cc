"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), as Claude Code speaks it.

A request becomes the one `ChatRequest`: `system` and the messages' blocks become HF-shaped
messages (tool_use -> an assistant's tool_calls, tool_result -> a tool message, thinking ->
reasoning_content), `tools` with `input_schema` become function tools, and the sampling fields go
through the option table. The answer is a `message` with content blocks, or Anthropic's SSE
events. `output_config.format` (a JSON schema) constrains the answer as `format` does.
Accepted and ignored: `metadata`, `cache_control`, `service_tier`, `output_config.effort`,
`container`, `speed` and the other fields the chat layer has no use for, a thinking block's
`signature`, `redacted_thinking` blocks, `thinking.budget_tokens`, and Anthropic's own server and
versioned tools (web_search_..., bash_..., text_editor_...), which are left out of the prompt.
Tools with `defer_loading: true` are not rendered either: a tool search tool finds them, run by
this server (anthropic_search.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from localllm.modelstore.store import ModelEntry

from ..chat.compaction import summary_message
from localllm.modelstore.custom import Customization
from ..chat.request import ChatRequest
from localllm.engine.runner.protocol import new_request_id
from .anthropic_context import context_edits, managed
from .anthropic_search import SearchRun, Tools, anthropic_tools, result_text
from .anthropic_writer import MessagesWriter
from .common import (
    answer_limit,
    bad_request,
    body_options,
    get_bool,
    message_images,
    read_json,
    requested_model,
)
from .respond import count_prompt_tokens, respond, served_model

routes = web.RouteTableDef()

# Anthropic's names for the table's options; temperature, top_p and top_k share the table's.
ANTHROPIC_NAMES = {"max_tokens": "num_predict", "stop_sequences": "stop"}

# ---- request -------------------------------------------------------------------------------
def _blocks(content, where: str) -> list[dict]:
    """A content field as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where} must be a string or a list of content blocks", "messages")
    return content


def _text(block: dict, where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", "messages")
    return text


def image_from_block(block: dict, where: str) -> str:
    """An `image` block as the chat layer carries images: base64 data (or the URL it names)."""
    source = block.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return source["data"]
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return source["url"]
    raise bad_request(f"{where}.source must be {{type: base64, media_type, data}} or "
                      f"{{type: url, url}}", "messages")


def system_prompt(body: dict) -> str | None:
    system = body.get("system")
    if system is None:
        return None
    blocks = _blocks(system, "system")
    return "\n\n".join(_text(b, f"system[{i}]") for i, b in enumerate(blocks)
                       if b.get("type") == "text")


def _tool_result(block: dict, where: str, names: dict[str, str], tools: Tools) -> dict:
    use_id = block.get("tool_use_id")
    if not isinstance(use_id, str):
        raise bad_request(f"{where}.tool_use_id must be a string", "messages")
    content = block.get("content", "")
    texts, images, referenced = [], [], []
    for j, part in enumerate(_blocks(content, f"{where}.content")):
        if part.get("type") == "text":
            texts.append(_text(part, f"{where}.content[{j}]"))
        elif part.get("type") == "image":
            images.append(image_from_block(part, f"{where}.content[{j}]"))
        elif part.get("type") == "tool_reference":  # a search the client ran: the tools found
            referenced.append(str(part.get("tool_name")))
    if referenced:
        texts.append(tools.deferred.definitions(referenced))
    text = "\n".join(texts)
    if block.get("is_error"):  # templates have no error flag: the model reads it in the text
        text = f"Error: {text}"
    if use_id not in names:
        raise bad_request(f"{where}.tool_use_id {use_id!r} answers no tool_use block before "
                          f"it: each tool_result follows the assistant's tool_use of that id",
                          "messages")
    out = {"role": "tool", "content": text, "tool_call_id": use_id, "name": names[use_id]}
    if images:
        out["images"] = images
    return out


def _user(i: int, blocks: list[dict], names: dict[str, str], tools: Tools) -> list[dict]:
    """A user turn: its tool results first (as tool messages), then its text and images."""
    results, texts, images = [], [], []
    for j, block in enumerate(blocks):
        where, kind = f"messages[{i}].content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "image":
            images.append(image_from_block(block, where))
        elif kind == "tool_result":
            results.append(_tool_result(block, where, names, tools))
        else:
            raise bad_request(f"{where}: a user block of type {kind!r} is not supported "
                              f"(text, image and tool_result are)", "messages")
    if texts or images or not results:
        user: dict = {"role": "user", "content": "\n".join(texts)}
        if images:
            user["images"] = images
        results.append(user)
    return results


def _call(block: dict, where: str, names: dict[str, str]) -> dict:
    """A tool_use (or a server_tool_use of the tool search) as the chat layer's tool call."""
    name, use_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(use_id, str):
        raise bad_request(f"{where} needs an id and a name", "messages")
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}.input must be an object", "messages")
    names[use_id] = name
    return {"type": "function", "id": use_id, "function": {"name": name, "arguments": arguments}}


def _assistant(where: str, blocks: list[dict], names: dict[str, str], tools: Tools
               ) -> list[dict]:
    """An assistant turn as messages: one, unless the server ran a tool search in it; then the
    search call ends one assistant message, its result is a tool message (the tools found),
    and what the model wrote after it is the next assistant message."""
    out: list[dict] = []
    texts, thinking, calls = [], [], []

    def close() -> None:
        message: dict = {"role": "assistant", "content": "".join(texts)}
        if calls:
            message["tool_calls"] = list(calls)
        if thinking:
            message["reasoning_content"] = message["thinking"] = "\n".join(thinking)
        out.append(message)
        texts.clear(), thinking.clear(), calls.clear()

    for j, block in enumerate(blocks):
        at, kind = f"{where}.content[{j}]", block.get("type")
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "tool_use" or (kind == "server_tool_use"
                                    and block.get("name") in tools.searches):
            calls.append(_call(block, at, names))
        elif kind == "tool_search_tool_result":
            use_id = block.get("tool_use_id")
            if use_id not in names:  # a search of a tool this request no longer offers
                continue
            close()
            out.append({"role": "tool", "content": result_text(block, tools.deferred),
                        "tool_call_id": use_id, "name": names[use_id]})
        elif kind in ("redacted_thinking", "server_tool_use", "web_search_tool_result"):
            continue  # nothing this server can read or run
        else:
            raise bad_request(f"{at}: an assistant block of type {kind!r} is not supported "
                              f"(text, thinking and tool_use are)", "messages")
    if texts or thinking or calls or not out:
        close()
    return out


def assistant_turns(blocks: list[dict], tools: Tools) -> list[dict]:
    """The blocks of an answer under way as the messages the next generation reads (the same
    messages the client's next request makes of them)."""
    return _assistant("content", blocks, {}, tools)


ROLES = ("user", "assistant", "system")


def _after_compaction(messages: list) -> tuple[str | None, list]:
    """(the summary of the last `compaction` block, the messages after it: the assistant turn
    that holds it keeps only the blocks after it); (None, messages) when there is none. What
    came before a compaction is left out, as Anthropic's API leaves it out."""
    for i in range(len(messages) - 1, -1, -1):
        message = messages[i]
        if not isinstance(message, dict) or message.get("role") != "assistant" \
                or not isinstance(message.get("content"), list):
            continue
        content = message["content"]
        for j in range(len(content) - 1, -1, -1):
            if isinstance(content[j], dict) and content[j].get("type") == "compaction":
                rest = [{**message, "content": content[j + 1:]}] if content[j + 1:] else []
                return str(content[j].get("content") or ""), rest + messages[i + 1:]
    return None, messages


def anthropic_messages(body: dict, tools: Tools | None = None) -> tuple[dict, ...]:
    """`system` and `messages` in the HF shape the chat layer renders (see get_messages). A
    system message among `messages` (Claude Code sends them) stays where it is: the chat layer
    places it as the model's template allows (chat/roles.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("field 'messages' must be a non-empty list of {role, content} "
                          "objects", "messages")
    tools = tools if tools is not None else anthropic_tools(body)
    system = system_prompt(body)
    out = [{"role": "system", "content": system}] if system else []
    summary, messages = _after_compaction(messages)
    if summary is not None:
        out.append(summary_message(summary))
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that follow
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise bad_request(f"messages[{i}] must be an object with role 'user', "
                              f"'assistant' or 'system'", "messages")
        blocks = _blocks(message.get("content", ""), f"messages[{i}].content")
        if message["role"] == "system":  # Claude Code's mid-conversation system turns
            out.append({"role": "system", "content": "\n\n".join(
                _text(b, f"messages[{i}].content[{j}]") for j, b in enumerate(blocks)
                if b.get("type") == "text")})
        elif message["role"] == "user":
            out += _user(i, blocks, names, tools)
        else:
            out += _assistant(f"messages[{i}]", blocks, names, tools)
    return tuple(out)


def anthropic_tool_choice(body: dict) -> tuple[str | dict, bool]:
    """(the chat layer's tool_choice, whether several calls may come in one answer)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", True
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = not get_bool(choice, "disable_parallel_tool_use", False) if kind else True
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}, parallel
    raise bad_request("tool_choice must be {type: auto}, {type: any}, {type: none} or "
                      "{type: tool, name: ...}", "tool_choice")


def anthropic_think(body: dict) -> bool | None:
    thinking = body.get("thinking")
    if thinking is None:
        return None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind == "disabled":
        return False
    if kind in ("enabled", "adaptive"):
        return True
    raise bad_request("thinking must be {type: enabled, budget_tokens: N} or "
                      "{type: disabled}", "thinking")


def anthropic_format(body: dict) -> dict | None:
    """`output_config.format` ({type: json_schema, schema}) -> the chat layer's format."""
    config = body.get("output_config")
    spec = config.get("format") if isinstance(config, dict) else None
    if spec is None:
        return None
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" \
            or not isinstance(spec.get("schema"), dict):
        raise bad_request("output_config.format must be {type: json_schema, schema: {...}}",
                          "output_config")
    return spec["schema"]


@dataclass
class Asked:
    """A /v1/messages request, translated."""
    entry: ModelEntry
    custom: Customization
    chat: ChatRequest
    parallel: bool  # whether several tool calls may come in one answer
    tools: Tools


async def chat_request(request: web.Request, body: dict, count_only: bool = False) -> Asked:
    entry, custom = await requested_model(request, body)
    if not count_only and body.get("max_tokens") is None:
        raise bad_request("missing required field 'max_tokens'", "max_tokens")
    answer_limit(body, "max_tokens")
    sampling, load = body_options(body, ANTHROPIC_NAMES, custom.parameters)
    tools = anthropic_tools(body)
    messages, images = message_images(anthropic_messages(body, tools))
    tool_choice, parallel = anthropic_tool_choice(body)
    think = anthropic_think(body)
    if think and entry.remote is None and not (
            await served_model(entry, custom)).style.thinking:
        think = None  # Claude Code asks every model to think: one that cannot just answers
    return Asked(entry, custom, ChatRequest(
        id=new_request_id(), model_name=entry.name.tagged, options=sampling, load=load,
        messages=messages, tools=tools.offered, tool_choice=tool_choice, think=think,
        format=anthropic_format(body), has_images=bool(images), images=images,
        workload_hint="/v1/messages"), parallel, tools)


# ---- routes ----------------------------------------------------------------------------------
@routes.post("/v1/messages")
async def messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    asked = await chat_request(request, body)
    edits = context_edits(body)
    chat = asked.chat
    writer = MessagesWriter(asked.entry.name.tagged, asked.parallel,
                            SearchRun(chat, asked.tools, assistant_turns))
    if edits is not None:
        writer.edits = []  # reported, also when none applies
    if edits:  # (clear_thinking alone needs no count of the prompt)
        chat, writer = await managed(request.app, asked.entry, asked.custom, chat, edits,
                                     writer, set(asked.tools.searches))
    return await respond(request, chat, writer, entry=asked.entry, custom=asked.custom,
                         stream=get_bool(body, "stream", False))


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    asked = await chat_request(request, body, count_only=True)
    return web.json_response({"input_tokens": await count_prompt_tokens(
        request.app, asked.entry, asked.chat, asked.custom)})

