"""/api/create (a model from a Modelfile subset, or Ollama's JSON fields) and /api/blobs.

    FROM <model name | sha256:<digest> of an uploaded blob | /path/to/file.gguf>
    PARAMETER <name> <value>        (repeat `stop` for several)
    TEMPLATE \"\"\"<Jinja chat template>\"\"\"
    SYSTEM \"\"\"<system prompt>\"\"\"

The new model shares the base's GGUF blob; what the Modelfile adds is stored as small blobs
(chat/custom.py). Ollama's JSON form (`from`, `files`, `template`, `system`, `parameters`) maps
onto the same thing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from localllm.modelstore.gguf_header import GGUFError, read_header
from localllm.modelstore.names import parse_name
from localllm.modelstore.shape import shape_from_header
from localllm.modelstore.store import (
    MODEL_LAYER,
    Layer,
    ModelStore,
    StoreError,
    model_details,
    no_room_is_disk_full,
)

from ..chat.custom import (
    CUSTOM_LAYERS,
    LICENSE_LAYER,
    MESSAGE_ROLES,
    MESSAGES_LAYER,
    OLLAMA_ONLY,
    PARAMS_LAYER,
    SYSTEM_LAYER,
    TEMPLATE_LAYER,
    ModelfileError,
    check_template,
    parameter_value,
    text_layer,
)
from .. import security
from ..state import SCHEDULER, STORE
from .common import ApiError, bad_request, get_bool, get_model_field, get_str, read_json

routes = web.RouteTableDef()
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass
class Recipe:
    base: str = ""  # model name, blob digest or file path
    parameters: dict = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    layers: tuple[Layer, ...] = ()  # stored blobs added as they are (an import's projector)
    messages: list[dict] = field(default_factory=list)  # MESSAGE lines
    license: str | None = None
    notes: list[str] = field(default_factory=list)  # what was taken but left out, said once


def parse_modelfile(text: str) -> Recipe:
    recipe = Recipe()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        command, rest = command.upper(), rest.strip()
        role = ""
        if command == "MESSAGE":
            role, _, rest = rest.partition(" ")
            role, rest = role.lower(), rest.strip()
            if role not in MESSAGE_ROLES:
                raise ModelfileError(f"MESSAGE takes a role of {', '.join(MESSAGE_ROLES)}, "
                                     f"not {role!r}")
        if command in ("TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE") and rest.startswith('"""'):
            rest, i = _quoted_block(command, rest[3:], lines, i)
        elif command in ("TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE") and len(rest) > 1 \
                and rest[0] == rest[-1] == '"':
            rest = rest[1:-1]
        if command == "FROM":
            recipe.base = rest
        elif command == "PARAMETER":
            key, _, value = rest.partition(" ")
            key = key.strip()
            if key in OLLAMA_ONLY:
                recipe.notes.append(f"parameter {key} left out (localllm has no such option)")
                continue
            value = parameter_value(key, value.strip())
            if key == "stop":
                recipe.parameters.setdefault("stop", []).append(value)
            else:
                recipe.parameters[key] = value
        elif command == "MESSAGE":
            recipe.messages.append({"role": role, "content": rest})
        elif command == "LICENSE":
            recipe.license = rest if recipe.license is None else f"{recipe.license}\n\n{rest}"
        elif command == "ADAPTER":
            raise ModelfileError("ADAPTER is not supported: localllm serves GGUF models without "
                                 "LoRA adapters; merge the adapter into the model first")
        elif command == "REQUIRES":
            raise ModelfileError("REQUIRES names an Ollama version; localllm cannot promise "
                                 "what a given Ollama version does: remove the line")
        elif command == "TEMPLATE":
            recipe.template = check_template(rest)
        elif command == "SYSTEM":
            recipe.system = rest
        else:
            raise ModelfileError(f"{command} is not supported; localllm's Modelfile takes FROM, "
                                 f"PARAMETER, TEMPLATE, SYSTEM, MESSAGE and LICENSE")
    return recipe


def _quoted_block(command: str, first: str, lines: list[str], i: int) -> tuple[str, int]:
    """The text of a \"\"\" block that opened with `first` on its line, and the index of the
    line after it; one pass over the lines (an unclosed block is an error, not a rescan)."""
    if '"""' in first:
        return first[: first.index('"""')], i
    parts = [first]
    for j in range(i, len(lines)):
        if '"""' in lines[j]:
            parts.append(lines[j][: lines[j].index('"""')])
            return "\n".join(parts), j + 1
        parts.append(lines[j])
    raise ModelfileError(f'{command} opens """ but never closes it')


def recipe_from_json(body: dict) -> Recipe:
    modelfile = get_str(body, "modelfile")
    recipe = parse_modelfile(modelfile) if modelfile else Recipe()
    base = get_str(body, "from")
    files = body.get("files")
    if files is not None:
        if not isinstance(files, dict) or len(files) != 1 or not all(
                isinstance(v, str) for v in files.values()):
            raise bad_request("field 'files' must map one GGUF file name to its blob digest",
                              "files")
        base = next(iter(files.values()))
    if base:
        recipe.base = base
    params = body.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise bad_request("field 'parameters' must be an object", "parameters")
        for key, value in params.items():
            if key in OLLAMA_ONLY:
                recipe.notes.append(f"parameter {key} left out (localllm has no such option)")
            elif key == "stop":
                stops = value if isinstance(value, list) else [value]
                recipe.parameters["stop"] = [parameter_value("stop", s) for s in stops]
            else:
                recipe.parameters[key] = parameter_value(key, value)
    if get_str(body, "template") is not None:
        recipe.template = check_template(body["template"])
    if get_str(body, "system") is not None:
        recipe.system = body["system"]
    messages = body.get("messages")
    if messages:
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and m.get("role") in MESSAGE_ROLES
                and isinstance(m.get("content"), str) for m in messages):
            raise bad_request("field 'messages' must be a list of {role, content} with a role "
                              f"of {', '.join(MESSAGE_ROLES)}", "messages")
        recipe.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    license_ = body.get("license")
    if license_:
        texts = license_ if isinstance(license_, list) else [license_]
        if not all(isinstance(t, str) for t in texts):
            raise bad_request("field 'license' must be a string or a list of strings", "license")
        recipe.license = "\n\n".join(texts)
    if body.get("adapters"):
        raise bad_request("field 'adapters' is not supported: localllm serves GGUF models "
                          "without LoRA adapters; merge the adapter into the model first",
                          "adapters")
    if body.get("quantize"):
        raise bad_request("field 'quantize' is not supported by localllm's create; pull the "
                          "quant you want (`localllm pull NAME --quant Q`)", "quantize")
    if not recipe.base:
        # The CLI sends the Modelfile alone: its user has no 'from' field to hear of.
        raise bad_request("a model needs a base: the Modelfile has no FROM line (FROM and a "
                          "stored model's name or a GGUF file)" if modelfile else
                          "a model needs a base: field 'from' (a stored model) or 'files' (a "
                          "GGUF blob), or FROM in field 'modelfile'", "from")
    return recipe


def _gguf_layer(store: ModelStore, digest: str) -> tuple[Layer, dict]:
    path = store.blob_path(digest)
    if not path.is_file():
        raise StoreError(f"blob {digest} is not in the store; upload it with POST "
                         f"/api/blobs/{digest} first")
    try:
        shape = shape_from_header(read_header(path), str(path))
    except GGUFError as e:
        raise StoreError(f"blob {digest} is not a GGUF model: {e}") from None
    return Layer(MODEL_LAYER, digest, path.stat().st_size), model_details(shape)


def is_path(base: str) -> bool:
    """Whether FROM names a file rather than a model or a blob."""
    return base.startswith(("/", "~", "./", "../"))


def build(store: ModelStore, name: str, recipe: Recipe) -> None:
    """Blocking (hashes and writes files): run it off the event loop."""
    target = parse_name(name)
    match = _DIGEST.match(recipe.base)
    if match:
        layer, details = _gguf_layer(store, f"sha256:{match.group(1)}")
        layers, source = [layer], f"create:{recipe.base}"
    elif is_path(recipe.base):
        path = Path(recipe.base).expanduser()
        entry = store.import_gguf(path, name)  # names the GGUF; the custom layers follow
        layers, details, source = list(entry.layers), entry.details, entry.source
    else:
        base = store.get(recipe.base)
        layers = list(base.layers)
        details, source = base.details, f"create:{base.name}"
    # A Modelfile's additions replace the base's, and inherit those it does not set.
    inherited = {layer.media_type: layer for layer in layers if layer.media_type in CUSTOM_LAYERS}
    layers = [layer for layer in layers if layer.media_type not in CUSTOM_LAYERS]
    if recipe.parameters:
        old = {}
        if PARAMS_LAYER in inherited:
            old = json.loads(store.blob_path(inherited[PARAMS_LAYER].digest).read_text())
        inherited[PARAMS_LAYER] = text_layer(store, PARAMS_LAYER,
                                             json.dumps({**old, **recipe.parameters}))
    if recipe.template is not None:
        inherited[TEMPLATE_LAYER] = text_layer(store, TEMPLATE_LAYER, recipe.template)
    if recipe.system is not None:
        inherited[SYSTEM_LAYER] = text_layer(store, SYSTEM_LAYER, recipe.system)
    if recipe.messages:
        inherited[MESSAGES_LAYER] = text_layer(store, MESSAGES_LAYER, json.dumps(recipe.messages))
    if recipe.license is not None:
        inherited[LICENSE_LAYER] = text_layer(store, LICENSE_LAYER, recipe.license)
    store.write_manifest(target, layers + list(inherited.values()) + list(recipe.layers),
                         details, source)


@routes.post("/api/create")
async def api_create(request: web.Request) -> web.Response:
    body = await read_json(request)
    name = get_model_field(body)
    try:  # a Modelfile may be megabytes: read it off the event loop
        recipe = await asyncio.to_thread(recipe_from_json, body)
    except ModelfileError as e:
        raise bad_request(str(e), "modelfile") from None
    if is_path(recipe.base):
        roots = request.app[SCHEDULER].config.import_roots
        source = await asyncio.to_thread(security.import_source, request, recipe.base, roots)
        recipe.base = str(source)
    await asyncio.to_thread(build, request.app[STORE], name, recipe)
    if not get_bool(body, "stream", True):
        return web.json_response({"status": "success",
                                  **({"notes": recipe.notes} if recipe.notes else {})})
    lines = [{"status": "using existing layers"}, *({"status": n} for n in recipe.notes),
             {"status": "writing manifest"}, {"status": "success"}]
    return web.Response(text="".join(json.dumps(x) + "\n" for x in lines),
                        content_type="application/x-ndjson")


@routes.head("/api/blobs/{digest}")
async def blob_exists(request: web.Request) -> web.Response:
    digest = request.match_info["digest"].replace("sha256-", "sha256:")
    has = request.app[STORE].has_blob(digest)
    return web.Response(status=200 if has else 404)


@routes.post("/api/blobs/{digest}")
async def blob_upload(request: web.Request) -> web.Response:
    """The body is the file; it is kept only when its sha256 is the digest in the path."""
    store: ModelStore = request.app[STORE]
    digest = request.match_info["digest"].replace("sha256-", "sha256:")
    match = _DIGEST.match(digest)
    if not match:
        raise bad_request(f"invalid blob digest {digest!r}; expected sha256:<64 hex digits>")
    if store.has_blob(digest):
        return web.Response(status=200)
    with no_room_is_disk_full(f"storing the upload of {digest}"):
        staged = store.staging_file("upload-")
    hasher = hashlib.sha256()
    try:
        with no_room_is_disk_full(f"storing the upload of {digest}"), staged.open("wb") as f:
            async for chunk in request.content.iter_chunked(1 << 20):
                hasher.update(chunk)
                await asyncio.to_thread(f.write, chunk)
        if hasher.hexdigest() != match.group(1):
            raise ApiError(400, f"digest mismatch: the upload's sha256 is {hasher.hexdigest()}, "
                                f"not {match.group(1)}")
        store.publish_blob(staged, match.group(1))
    finally:
        staged.unlink(missing_ok=True)
    return web.Response(status=201)
