"""/api/create (a model from a Modelfile subset, or Ollama's JSON fields) and /api/blobs.

    FROM <model name | sha256:<digest> of an uploaded blob | /path/to/file.gguf>
    PARAMETER <name> <value>        (repeat `stop` for several)
    TEMPLATE \"\"\"<Jinja chat template>\"\"\"
    SYSTEM \"\"\"<system prompt>\"\"\"

The new model shares the base's GGUF blob; what the Modelfile adds is stored as small blobs
(modelstore/modelfile.py builds it, modelstore/custom.py stores it). Ollama's JSON form
(`from`, `files`, `template`, `system`, `parameters`) maps onto the same thing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from aiohttp import web
from localllm.modelstore.custom import (
    MESSAGE_ROLES,
    OLLAMA_ONLY,
    ModelfileError,
    parameter_value,
)
from localllm.modelstore.modelfile import (
    BLOB_DIGEST,
    Recipe,
    build,
    is_path,
    parse_modelfile,
    take_template,
)
from localllm.modelstore.store import ModelStore, no_room_is_disk_full

from .. import security
from ..state import SCHEDULER, STORE
from .common import ApiError, bad_request, get_bool, get_model_field, get_str, read_json

routes = web.RouteTableDef()


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
        take_template(recipe, body["template"])
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
    match = BLOB_DIGEST.match(digest)
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
