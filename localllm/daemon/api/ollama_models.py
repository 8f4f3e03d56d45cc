"""Ollama's model routes (/api/tags, show, delete, copy, import) and the daemon's own
(/api/version, /api/status), as Ollama's api/types.go has them."""

from __future__ import annotations

import asyncio
import json
import os

from aiohttp import web
from localllm.modelstore.projector import projector_info, show_info
from localllm.modelstore.store import ManifestDamaged, projector_path

from localllm import __version__
from localllm.config import DAEMON_ONLY, ENV

from .. import remote, security
from ..chat.model import capabilities
from ..chat.model import model_for
from ..chat.template import DEFAULT_TEMPLATE
from ..state import CONFIG, SCHEDULER, STORE, aliases_json
from .common import customization, find_model, get_bool, get_model_field, get_str, read_json
from .ollama import OLLAMA_API_LEVEL, STARTED_AT, iso, model_json

routes = web.RouteTableDef()


@routes.get("/api/version")
async def api_version(request: web.Request) -> web.Response:
    """The Ollama API level these routes match (clients gate features on it; VS Code refuses
    anything below 0.6.4), and localllm's own version beside it."""
    return web.json_response({"version": OLLAMA_API_LEVEL, "localllm_version": __version__})


@routes.get("/api/status")
async def api_status(request: web.Request) -> web.Response:
    """The daemon itself: which process, since when, and what it holds loaded."""
    scheduler = request.app[SCHEDULER]
    return web.json_response({
        "version": __version__,
        "ollama_api": OLLAMA_API_LEVEL,
        "pid": os.getpid(),
        "started_at": iso(STARTED_AT),
        # the daemon-only settings its environment set (a client compares its own: client.py)
        "env": {ENV[name]: os.environ[ENV[name]] for name in DAEMON_ONLY
                if os.environ.get(ENV[name])},
        "loaded": [{"model": name, "runner_pid": slot.runner.pid, "busy": slot.busy,
                    "active": slot.active, "waiting": slot.waiting,
                    "num_parallel": slot.runner.n_parallel,
                    "tokens_generated": slot.runner.tokens_generated}
                   for name, slot in scheduler.models.items()],
    })


@routes.get("/api/tags")
async def api_tags(request: web.Request) -> web.Response:
    """The stored models; those whose manifest is damaged apart, each with what is wrong (a
    key Ollama's clients ignore), so that one bad file hides no other model; the aliases where
    any are set."""
    entries, damaged = await asyncio.to_thread(request.app[STORE].scan)
    body: dict = {"models": [model_json(e) for e in entries], **aliases_json(request.app)}
    if damaged:
        body["damaged"] = [{"name": str(bad.name), "model": bad.name.tagged,
                            "error": bad.reason} for bad in damaged]
    return web.json_response(body)


def show_parameters(num_ctx: int, stops: list[str], stored: dict) -> str:
    """Ollama's `parameters` text: one `name value` line each, strings quoted (Continue reads
    `num_ctx` and JSON-parses each `stop`)."""
    lines = [("num_ctx", str(num_ctx))]
    for key, value in stored.items():
        if key in ("num_ctx", "stop"):
            continue
        lines.append((key, json.dumps(value) if isinstance(value, str) else str(value)))
    lines += [("stop", json.dumps(stop)) for stop in stored.get("stop", stops)]
    return "\n".join(f"{key:<30} {value}" for key, value in lines)


@routes.post("/api/show")
async def api_show(request: web.Request) -> web.Response:
    body = await read_json(request)
    entry = find_model(request, get_model_field(body))
    if entry.remote is not None:  # there is no GGUF to describe, only where it lives
        return web.json_response(remote.show(entry))
    model = await model_for(entry)
    custom = await customization(request, entry)
    slot = request.app[SCHEDULER].models.get(entry.name.tagged)
    num_ctx = custom.parameters.get("num_ctx") or (
        slot.runner.n_ctx if slot else request.app[CONFIG].default_ctx)
    # A model without a template is chatted with through Ollama's default, and shown so.
    template = custom.template or model.template or DEFAULT_TEMPLATE
    details = {key: value if isinstance(value, list) else str(value)
               for key, value in {"parent_model": "", **entry.details}.items()}
    modelfile = f"FROM {entry.model_path}\n"
    if custom.template:
        modelfile += f'TEMPLATE """{custom.template}"""\n'
    if custom.system:
        modelfile += f'SYSTEM """{custom.system}"""\n'
    # the parameters `parameters` lists, the stop markers included (the template's where none
    # is stored); num_ctx where it is stored (the loaded context is not the model's setting)
    for line in show_parameters(num_ctx, model.stop_pieces, custom.parameters).splitlines():
        key, _, value = line.partition(" ")
        if key != "num_ctx" or "num_ctx" in custom.parameters:
            modelfile += f"PARAMETER {key} {value.strip()}\n"
    for message in custom.messages:
        modelfile += f'MESSAGE {message["role"]} """{message["content"]}"""\n'
    if custom.license:
        modelfile += f'LICENSE """{custom.license}"""\n'
    info = dict(model.info)
    if request.headers.get("User-Agent", "").startswith("GitHubCopilotChat/"):
        info["general.basename"] = entry.name.tagged  # what Ollama does: Copilot shows this name
    projector = projector_path(request.app[STORE], entry)
    extra = {}
    if projector is not None:  # Ollama's projector_info: the mmproj's clip.* keys
        found = await asyncio.to_thread(projector_info, projector)
        extra["projector_info"] = show_info(found)
    return web.json_response({**extra,
        "license": custom.license or str(model.info.get("general.license", "")),
        **({"messages": list(custom.messages)} if custom.messages else {}),
        "modelfile": modelfile,
        "parameters": show_parameters(num_ctx, model.stop_pieces, custom.parameters),
        "template": template,
        "system": custom.system or "",
        "details": details,
        "model_info": info,
        "capabilities": capabilities(model, custom),
        "modified_at": entry.modified_at,
    })


@routes.delete("/api/delete")
async def api_delete(request: web.Request) -> web.Response:
    body = await read_json(request)
    name = get_model_field(body)
    try:
        model = find_model(request, name).name
    except ManifestDamaged as e:  # removable: its own message says `localllm rm` it
        model = e.name
    await request.app[SCHEDULER].unload(model.tagged)  # never delete a file in use
    await asyncio.to_thread(request.app[STORE].remove, model)
    return web.json_response({})


@routes.post("/api/import")
async def api_import(request: web.Request) -> web.Response:
    """A GGUF file on this machine into the store (what `localllm import` does without a
    daemon). The daemon runs as the user, so it reads only what the user could read."""
    body = await read_json(request)
    name = get_str(body, "model", required=True)
    path = get_str(body, "path", required=True)
    link = not get_bool(body, "copy", False)
    roots = request.app[SCHEDULER].config.import_roots
    source = await asyncio.to_thread(security.import_source, request, path, roots)
    entry = await asyncio.to_thread(request.app[STORE].import_gguf, source, name, link)
    return web.json_response(model_json(entry))


@routes.post("/api/copy")
async def api_copy(request: web.Request) -> web.Response:
    body = await read_json(request)
    source = get_str(body, "source", required=True)
    destination = get_str(body, "destination", required=True)
    await asyncio.to_thread(request.app[STORE].copy, source, destination)  # waits on a lock
    return web.json_response({})
