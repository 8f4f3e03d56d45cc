"""Request validation and errors shared by the routes of every wire format.

Handlers raise `ApiError` (or a known domain error); the error middleware in server.py turns
it into the right JSON shape for the route's API family. No handler formats an error itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from typing import Any

from aiohttp import web
from localllm.modelstore.names import BadModelName
from localllm.modelstore.pull import not_stored
from localllm.modelstore.store import ModelEntry, ModelNotFound, StoreError

from localllm import options
from localllm.options import LoadOptions, SamplingOptions

from ..aliases import alias_target
from localllm.modelstore.custom import CUSTOM_LAYERS, Customization, read_customization
from ..chat.images import ImageSource, slot
from ..http_errors import ApiError, bad_request
from ..state import STORE, live_config


MAX_BODY_BYTES = 32 * 1024 * 1024  # the app's client_max_size: past it, a 413
_MAX_INT = 1 << 63  # no field of either API holds a number past int64


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _checked_int(text: str) -> int:
    value = int(text)
    if not -_MAX_INT <= value < _MAX_INT:
        raise ValueError(f"number {text[:24]}... is out of range")
    return value


def _checked_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:24]} is out of range")
    return value


def _lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) in a parsed body holds a lone UTF-16 surrogate, which
    JSON's \\ud800 escapes allow but UTF-8 (llama.cpp, our answers) cannot carry."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


BODY = "localllm.body"  # the request's parsed body, read once (a middleware may read it first)
MODEL = "localllm.model"  # (name, the stored model or the error its lookup raised)


async def read_json(request: web.Request) -> dict:
    """The request body as a JSON object, or a 400 (413 when too big) saying what is wrong.

    Stricter than json.loads: no NaN or Infinity, integers within int64, no lone surrogates,
    so nothing a handler passes on can fail later for a reason the client caused. Parsed once
    a request: a second call answers what the first found."""
    if BODY not in request:
        request[BODY] = await _read_json(request)
    return request[BODY]


async def _read_json(request: web.Request) -> dict:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body is larger than {MAX_BODY_BYTES >> 20} MiB") from None
    if not raw.strip():
        raise bad_request("request body is empty: send a JSON object")
    if len(raw) < BIG_BODY_BYTES:
        return _parse_body(raw)
    # A big body takes the loop a while and its objects many times its size: parse it on a
    # thread, a few at a time (two 30 MiB bodies at once stalled everyone 2.5 s, +841 MiB).
    async with _big_body_slots():
        return await asyncio.to_thread(_parse_body, raw, _yielding_object)


BIG_BODY_BYTES = 1 << 20
_BIG_BODIES_AT_ONCE = 2
_big_bodies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _big_body_slots() -> asyncio.Semaphore:
    """The running loop's semaphore (one per loop: a semaphore belongs to the loop it waits on)."""
    loop = asyncio.get_running_loop()
    if loop not in _big_bodies:
        _big_bodies[loop] = asyncio.Semaphore(_BIG_BODIES_AT_ONCE)
    return _big_bodies[loop]


def _yielding_object(pairs: list) -> dict:
    """dict(pairs), as Python code: json's C parser holds the GIL from start to end unless it
    calls back into Python, and a callback per object lets the event loop's thread have the
    GIL every switch interval while a big body is parsed on a worker thread."""
    return dict(pairs)


def _parse_body(raw: bytes, object_pairs_hook=None) -> dict:
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant,
                          parse_int=_checked_int, parse_float=_checked_float,
                          object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError:
        raise bad_request("request body is not UTF-8") from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and the checks above
        raise bad_request(f"invalid JSON in request body: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    if _lone_surrogate(body):
        raise bad_request("request body holds a lone UTF-16 surrogate (e.g. \\ud800): strings "
                          "must be valid Unicode")
    return body


def get_str(body: dict, key: str, required: bool = False, default: str | None = None) -> str | None:
    value = body.get(key)
    if value is None:
        if required:
            raise bad_request(f"missing required field '{key}'", key)
        return default
    if not isinstance(value, str):
        raise bad_request(f"field '{key}' must be a string", key)
    return value


async def requested_model(request: web.Request, body: dict
                          ) -> tuple[ModelEntry, Customization]:
    """The stored model a request's `model` names (404 naming it when there is none), local or
    remote, and what its Modelfile added."""
    entry = find_model(request, get_str(body, "model", required=True))
    return entry, await customization(request, entry)


# What a manifest's layers say, by its digest: blobs never change, so neither does this.
_customizations: dict[str, Customization] = {}


async def customization(request: web.Request, entry: ModelEntry) -> Customization:
    """What the model's Modelfile added, read off the event loop once per manifest. A model
    stored without one (no parameters, template or system layer: most) has nothing to read,
    and a request for it never enters the Modelfile code."""
    found = _customizations.get(entry.manifest_digest)
    if found is None:
        found = Customization()
        if any(entry.companion(layer) for layer in CUSTOM_LAYERS):
            found = await asyncio.to_thread(read_customization, request.app[STORE], entry)
        remember(_customizations, entry.manifest_digest, found)
    return found


def find_model(request: web.Request, name: str) -> ModelEntry:
    """The stored model `name` names, or that its alias names (the `model_aliases` setting:
    a stored model of that name comes first), looked up once a request (ModelNotFound -> 404
    in the middleware)."""
    found = request.get(MODEL)
    if found is None or found[0] != name:
        try:
            found = (name, known_entry(request.app, name))
        except (StoreError, BadModelName) as e:
            target = alias_target(live_config(request.app).model_aliases, name)
            if target is not None:
                found = (name, _aliased(request.app, name, target))
            else:  # a name not stored: the 404 says whether a pull could fetch it
                found = (name, not_stored(name) if isinstance(e, ModelNotFound) else e)
        request[MODEL] = found
    if isinstance(found[1], Exception):
        raise found[1]
    return found[1]


def _aliased(app: web.Application, name: str, target: str) -> ModelEntry | Exception:
    try:
        return known_entry(app, target)
    except (StoreError, BadModelName) as e:
        return ModelNotFound(f"model {name!r} is an alias (model_aliases) of {target!r}, "
                             f"which is not stored here: {e}")


# The store's entries by the name a request gave, each with its manifest file and that file's
# (inode, size, mtime) when it was read. Whatever changes a model (a pull, rm, cp, create or
# import, by this daemon or by the CLI writing the store itself) removes that file or renames a
# new one over it, which the stat of the next request sees.
KNOWN = web.AppKey("known_models", dict)
KNOWN_AT_MOST = 256  # keys a per-request cache holds (remember)


def known_entry(app: web.Application, name: str) -> ModelEntry:
    """`app[STORE].get(name)`, read again only when its manifest file changed: a request to a
    model already seen parses no name and reads no manifest, one stat instead."""
    known = app[KNOWN]
    found = known.get(name)
    if found is not None:
        path, stamp, entry = found
        if _stamp(path) == stamp:
            return entry
        del known[name]
    store = app[STORE]
    path = store.manifest_file(name)
    stamp = _stamp(path)  # before reading: a change meanwhile is seen next time
    entry = store.get(name)
    if stamp is not None:
        remember(known, name, (path, stamp, entry))
    return entry


def remember(cache: dict, key, value) -> None:
    """`cache[key] = value` in a per-request cache, emptied first once it holds KNOWN_AT_MOST
    keys: clients that spell one model many ways grow no memory."""
    if len(cache) >= KNOWN_AT_MOST:
        cache.clear()
    cache[key] = value


def _stamp(path) -> tuple | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def get_model_field(body: dict) -> str:
    """The model a request names: `model`, or `name` as older Ollama clients send it."""
    name = get_str(body, "model") or get_str(body, "name")
    if not name:
        raise bad_request("missing required field 'model'", "model")
    return name


def get_bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"field '{key}' must be true or false", key)
    return value


def get_number(body: dict, key: str, kind: type = float, minimum: float | None = None,
               maximum: float | None = None) -> Any:
    """A number field or None; ints are accepted where floats are asked for, not vice versa."""
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise bad_request(f"field '{key}' must be {'an integer' if kind is int else 'a number'}",
                          key)
    value = kind(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise bad_request(f"field '{key}' is out of range", key)
    return value


def answer_limit(body: dict, key: str, minimum: int = 1) -> None:
    """A wire format's answer limit (max_tokens, max_output_tokens) is a whole number of at
    least `minimum` where given: Anthropic and OpenAI refuse 0 and negatives (Ollama's -1,
    "no limit", is num_predict's, not theirs), and a -1 here would run to the context's end."""
    value = body.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not float(value).is_integer() or value < minimum:
        raise bad_request(f"field '{key}' must be an integer of at least {minimum}; got "
                          f"{json.dumps(value)[:40]}", key)


def parse_options(values: dict, labels: dict | None = None,
                  stored: dict | None = None) -> tuple[SamplingOptions, LoadOptions]:
    """A request's options through the one option table (localllm/options.py), over a
    Modelfile's stored PARAMETERs; `labels` names an option as the client's format does."""
    try:
        return options.parse({**(stored or {}), **values}, labels)
    except options.OptionError as e:
        raise bad_request(str(e), e.name) from None


def body_options(body: dict, names: dict[str, str], stored: dict | None = None
                 ) -> tuple[SamplingOptions, LoadOptions]:
    """Options sent as top-level fields (OpenAI, Anthropic, Responses): `names` maps the wire
    format's own names onto the table's (earlier entries win); every other option of the table
    is taken under its own name (top_k, min_p, num_ctx...), as llama-server and vLLM take
    extras. An error names the field as the client sent it."""
    values = {k: v for k, v in body.items() if k in options.OPTIONS}
    labels = {}
    for theirs, ours in reversed(names.items()):
        if body.get(theirs) is not None:
            values[ours], labels[ours] = body[theirs], theirs
    return parse_options(values, labels, stored)


def kept_calls(calls: list, parallel: bool) -> list:
    """The tool calls an answer returns: only the first when the client asked for one."""
    return calls if parallel else [c for c in calls if c.index == 0]


def get_messages(body: dict, images: list | None = None) -> tuple[dict, ...]:
    """Ollama or OpenAI messages in the shape Hugging Face chat templates read: `content` a
    string, assistant `tool_calls` as [{"type", "id", "function": {"name", "arguments": {}}}],
    tool results with `tool_call_id` and `name`, earlier thinking as `reasoning_content`.

    Images (Ollama `images`, OpenAI `image_url` parts) are appended to `images` as
    ImageSources, their slot written in the content where each stands (chat/images.py)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise bad_request("field 'messages' must be a list of {role, content} objects", "messages")
    images = [] if images is None else images
    return tuple(_message(i, message, images) for i, message in enumerate(messages))


def get_prompt_images(body: dict, images: list) -> str:
    """/api/generate's `images` (base64) as ImageSources; returns their slots, which go
    before the prompt as Ollama places them."""
    return _ollama_images(body.get("images"), "images", images)


def _ollama_images(value, where: str, images: list) -> str:
    if value is None:
        return ""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{where} must be a list of base64 strings", "images")
    slots = ""
    for j, data in enumerate(value):
        slots += slot(len(images))
        images.append(ImageSource(f"{where}[{j}]", data=data))
    return slots


def _image_part(i: int, j: int, part: dict, images: list) -> str:
    """An OpenAI `image_url` part: {"image_url": {"url": "data:..." | "https://..."}} (or the
    URL as a bare string)."""
    where = f"messages[{i}].content[{j}].image_url"
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where} needs a url (a data: URL or http(s))", "messages")
    source = ImageSource(where, data=url) if url.startswith("data:") else ImageSource(where,
                                                                                     url=url)
    images.append(source)
    return slot(len(images) - 1)


def _message(i: int, message, images: list) -> dict:
    if not isinstance(message, dict):
        raise bad_request(f"messages[{i}] must be an object", "messages")
    role = message.get("role")
    if role not in ("system", "user", "assistant", "tool", "developer"):
        raise bad_request(f"messages[{i}].role must be system, user, assistant or tool",
                          "messages")
    content = message.get("content", "")
    if isinstance(content, list):  # OpenAI content parts: text, and images where they stand
        if not all(isinstance(p, dict) for p in content):
            raise bad_request(f"messages[{i}].content parts must be objects", "messages")
        content = "".join(
            p.get("text", "") if p.get("type") == "text"
            else _image_part(i, j, p, images) if p.get("type") == "image_url" else ""
            for j, p in enumerate(content))
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"messages[{i}].content must be a string", "messages")
    content = _ollama_images(message.get("images"), f"messages[{i}].images", images) + content
    out: dict = {"role": "system" if role == "developer" else role, "content": content}
    calls = message.get("tool_calls")
    if calls:
        if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            raise bad_request(f"messages[{i}].tool_calls must be a list of objects", "messages")
        out["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(calls)]
    if role == "tool":
        name = message.get("tool_name") or message.get("name")
        if name is not None:
            out["name"] = str(name)
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = str(message["tool_call_id"])
    thinking = message.get("thinking") or message.get("reasoning_content")
    if isinstance(thinking, str) and thinking:
        out["reasoning_content"] = thinking
        out["thinking"] = thinking
    return out


def _tool_call(i: int, j: int, call: dict) -> dict:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{i}].tool_calls[{j}].function needs a name", "messages")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):  # OpenAI sends the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                              f"valid JSON", "messages") from None
    if not isinstance(arguments, dict):
        raise bad_request(f"messages[{i}].tool_calls[{j}].function.arguments must be an "
                          f"object", "messages")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id"):
        out["id"] = str(call["id"])
    return out


def message_images(messages: tuple[dict, ...]) -> tuple[tuple[dict, ...], tuple]:
    """Messages carrying `images` (base64, data: or http(s) URLs, as the Anthropic and
    Responses routes collect them) -> the messages with each image's slot written at the start
    of its content, and the ImageSources (chat/images.py), as get_messages gives them."""
    images: list = []
    out = []
    for i, message in enumerate(messages):
        if not message.get("images"):
            out.append(message)
            continue
        slots = ""
        for j, value in enumerate(message["images"]):
            where = f"messages[{i}].images[{j}]"
            slots += slot(len(images))
            images.append(ImageSource(where, url=value) if value.startswith(
                ("http://", "https://")) else ImageSource(where, data=value))
        out.append({**{k: v for k, v in message.items() if k != "images"},
                    "content": slots + message["content"]})
    return tuple(out), tuple(images)


def has_images(body: dict) -> bool:
    """Whether any message carries an image (Ollama `images`, OpenAI `image_url` parts)."""
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("images"):
            return True
        content = message.get("content")
        if isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") in ("image_url", "input_image")
                for p in content):
            return True
    return bool(body.get("images"))


def get_tools(body: dict) -> tuple[dict, ...]:
    """`tools` in the OpenAI shape, which Ollama shares: [{"type": "function", "function":
    {"name", "description", "parameters"}}]."""
    tools = body.get("tools")
    if tools is None:
        return ()
    if not isinstance(tools, list):
        raise bad_request("field 'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                              f"{{\"name\": ...}}}}", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object",
                              "tools")
        out.append({"type": "function", "function": function})
    return tuple(out)


def get_tool_choice(body: dict):
    """OpenAI's `tool_choice` (also taken on /api/chat, a localllm addition): "auto", "none",
    "required" or a named function, which the chat layer enforces with a grammar."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict) and isinstance(
            choice["function"].get("name"), str):
        return {"name": choice["function"]["name"]}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or "
                      "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
