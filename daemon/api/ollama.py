"""Ollama's native API (/api/*): request and response shapes, as Ollama's api/types.go has them.

Durations on the wire are nanoseconds; `num_ctx` on the wire is `n_ctx` inside.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from localllm.modelstore.shape import read_shape
from localllm.modelstore.store import ModelEntry

from localllm import __version__
from localllm.config import ConfigError, parse_duration

from .. import remote
from ..runner.protocol import Done, Failure, GenerationRequest, Progress, SamplingOptions, Token
from ..generation import Generation, collect, find_model, first_event, generate, hold
from ..runner.process import new_request_id
from ..state import SCHEDULER, STORE
from .common import (
    bad_request,
    get_bool,
    get_messages,
    get_model_field,
    get_number,
    get_stop,
    get_str,
    read_json,
)

routes = web.RouteTableDef()
NDJSON = "application/x-ndjson"  # Ollama streams one JSON object a line
FOREVER = "2318-08-12T00:00:00Z"
STARTED_AT = time.time()  # what Ollama reports for a model kept loaded forever


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


# ---- request parsing -----------------------------------------------------------------------
def parse_options(body: dict) -> tuple[SamplingOptions, int | None, dict]:
    """Ollama `options` -> sampling options, requested n_ctx, and load-time options."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise bad_request("field 'options' must be an object", "options")
    num = lambda key, kind=float, lo=None, hi=None: get_number(options, key, kind, lo, hi)
    defaults = SamplingOptions()
    sampling = SamplingOptions(
        temperature=_pick(num("temperature", float, 0, 100), defaults.temperature),
        top_k=_pick(num("top_k", int, 0), defaults.top_k),
        top_p=_pick(num("top_p", float, 0, 1), defaults.top_p),
        min_p=_pick(num("min_p", float, 0, 1), defaults.min_p),
        typical_p=_pick(num("typical_p", float, 0, 1), defaults.typical_p),
        repeat_penalty=_pick(num("repeat_penalty", float, 0), defaults.repeat_penalty),
        repeat_last_n=_pick(num("repeat_last_n", int, -1), defaults.repeat_last_n),
        presence_penalty=_pick(num("presence_penalty"), defaults.presence_penalty),
        frequency_penalty=_pick(num("frequency_penalty"), defaults.frequency_penalty),
        seed=num("seed", int),
        num_predict=_pick(num("num_predict", int, -2), defaults.num_predict),
        stop=get_stop(options),
    )
    n_ctx = num("num_ctx", int, 256, 1 << 24)
    load = {}
    for key in ("num_gpu", "num_thread", "num_batch"):
        value = num(key, int, -1)
        if value is not None:
            load[key] = value
    return sampling, n_ctx, load


def _pick(value, default):
    return default if value is None else value


def parse_keep_alive(body: dict):
    value = body.get("keep_alive")
    if value is None:
        return "default"
    try:
        return parse_duration(value)
    except ConfigError as e:
        raise bad_request(str(e), "keep_alive") from None


@dataclass(frozen=True)
class Common:
    """What /api/generate and /api/chat share, parsed once: the model, the sampling options,
    the load options (num_ctx and the rest) and how to answer."""

    entry: ModelEntry
    sampling: SamplingOptions
    n_ctx: int | None
    load: dict
    keep_alive: float | None | str
    stream: bool


def parse_common(app: web.Application, body: dict) -> Common:
    sampling, n_ctx, load = parse_options(body)
    return Common(entry=find_model(app, get_str(body, "model", required=True)),
                  sampling=sampling, n_ctx=n_ctx, load=load,
                  keep_alive=parse_keep_alive(body), stream=get_bool(body, "stream", True))


def metrics(gen: Generation, done: Done) -> dict:
    return {
        "done_reason": done.done_reason,
        "total_duration": gen.total_duration_ns(),
        "load_duration": gen.load_duration_ns,
        "prompt_eval_count": done.prompt_eval_count,
        "prompt_eval_duration": done.prompt_eval_duration_ns,
        "eval_count": done.eval_count,
        "eval_duration": done.eval_duration_ns,
        # localllm additions (clients that do not know them ignore them)
        "prompt_tokens": done.prompt_tokens,
        "context_used": done.context_used,
        "context_length": done.n_ctx,
    }


def live_stats(event: Token | Done, n_ctx: int, ttft_ns: int) -> dict:
    """The runner's running totals for one chunk (a localllm addition to Ollama's lines), so a
    client can show decode speed, prompt speed and context use while the answer streams."""
    stats = {
        "eval_count": event.eval_count,
        "eval_duration": event.eval_duration_ns,
        "prompt_eval_count": event.prompt_eval_count,
        "prompt_eval_duration": event.prompt_eval_duration_ns,
        "context_used": event.context_used,
        "context_length": n_ctx,
        "time_to_first_token": ttft_ns,  # request received -> first text sent, load included
    }
    if event.drafted is not None:  # only while speculative decoding is on
        stats["draft"] = {"drafted": event.drafted, "accepted": event.draft_accepted or 0}
    return stats


# ---- generate and chat -----------------------------------------------------------------
async def _respond(request: web.Request, common: Common, gen_request: GenerationRequest,
                   shape_chunk, final_extra) -> web.StreamResponse:
    """Run a generation and answer as NDJSON (stream) or one object (stream:false)."""
    model = str(common.entry.name)
    async with generate(request.app, common.entry, gen_request, common.n_ctx, common.load,
                        common.keep_alive) as gen:
        if not common.stream:
            text, done = await collect(gen)
            return web.json_response({"model": model, "created_at": now_iso(),
                                      **shape_chunk(text), "done": True, **final_extra(done),
                                      **metrics(gen, done)})
        response = web.StreamResponse(headers={"Content-Type": NDJSON})
        first = await first_event(gen)
        await response.prepare(request)
        event = first
        ttft_ns = 0  # request received -> first answer text, set at the first token
        while True:
            if isinstance(event, Token):
                ttft_ns = ttft_ns or gen.total_duration_ns()
                line = {"model": model, "created_at": now_iso(), **shape_chunk(event.text),
                        "done": False, "stats": live_stats(event, gen.runner.n_ctx, ttft_ns)}
            elif isinstance(event, Progress):  # a long prompt is being read (localllm addition)
                line = {"model": model, "created_at": now_iso(), **shape_chunk(""),
                        "done": False, "progress": {"prompt_read": event.prompt_read,
                                                    "prompt_total": event.prompt_total}}
            elif isinstance(event, Failure):
                line = {"error": event.message}
            else:
                line = {"model": model, "created_at": now_iso(), **shape_chunk(""), "done": True,
                        **final_extra(event), **metrics(gen, event),
                        "stats": live_stats(event, event.n_ctx, ttft_ns)}
            try:
                await response.write(json.dumps(line).encode() + b"\n")
            except ConnectionError:
                return response  # client went away: leaving `generate` cancels the runner
            if not isinstance(event, (Token, Progress)):
                break
            event = await anext(gen.events)
        await response.write_eof()
        return response


@routes.post("/api/generate")
async def api_generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if (remote_model := remote.remote_entry(request.app, body)) is not None:
        return await remote.ollama(request, body, remote_model)
    prompt = get_str(body, "prompt", default="")
    common = parse_common(request.app, body)
    if not prompt:
        return await _load_only(request, common)
    gen_request = GenerationRequest(
        id=new_request_id(), prompt=prompt, system=get_str(body, "system"),
        raw=get_bool(body, "raw", False), options=common.sampling,
    )
    return await _respond(request, common, gen_request, lambda text: {"response": text},
                          lambda done: {"context": list(done.context)})


@routes.post("/api/chat")
async def api_chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if (remote_model := remote.remote_entry(request.app, body)) is not None:
        return await remote.ollama(request, body, remote_model)
    common = parse_common(request.app, body)
    if body.get("messages") in (None, []):
        return await _load_only(request, common)
    gen_request = GenerationRequest(id=new_request_id(), messages=get_messages(body),
                                    options=common.sampling)
    return await _respond(request, common, gen_request,
                          lambda text: {"message": {"role": "assistant", "content": text}},
                          lambda done: {})


async def _load_only(request: web.Request, common: Common) -> web.Response:
    """An empty prompt loads the model; with keep_alive 0 it unloads it (`ollama stop`)."""
    app, entry = request.app, common.entry
    key = "message" if request.path == "/api/chat" else "response"
    empty = {"role": "assistant", "content": ""} if key == "message" else ""
    if common.keep_alive == 0:
        await app[SCHEDULER].unload(str(entry.name))
        reason = "unload"
    else:
        async with hold(app, entry, common.n_ctx, common.load, common.keep_alive):
            pass
        reason = "load"
    return web.json_response({"model": str(entry.name), "created_at": now_iso(), key: empty,
                              "done": True, "done_reason": reason})


# ---- models --------------------------------------------------------------------------------
def _model_json(entry) -> dict:
    return {"name": str(entry.name), "model": str(entry.name), "modified_at": entry.modified_at,
            "size": entry.size, "digest": entry.digest.removeprefix("sha256:"),
            "details": entry.details}


@routes.get("/api/version")
async def api_version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


@routes.get("/api/status")
async def api_status(request: web.Request) -> web.Response:
    """The daemon itself: which process, since when, and what it holds loaded."""
    scheduler = request.app[SCHEDULER]
    return web.json_response({
        "version": __version__,
        "pid": os.getpid(),
        "started_at": iso(STARTED_AT),
        "loaded": [{"model": name, "runner_pid": slot.runner.pid, "busy": slot.busy,
                    "active": slot.active, "waiting": slot.waiting,
                    "num_parallel": slot.runner.n_parallel,
                    "tokens_generated": slot.runner.tokens_generated}
                   for name, slot in scheduler.models.items()],
    })


@routes.get("/api/tags")
async def api_tags(request: web.Request) -> web.Response:
    return web.json_response({"models": [_model_json(e) for e in request.app[STORE].list()]})


@routes.post("/api/show")
async def api_show(request: web.Request) -> web.Response:
    body = await read_json(request)
    name = get_model_field(body)
    entry = find_model(request.app, name)
    if entry.remote is not None:
        return web.json_response(remote.show(entry))
    shape = await asyncio.to_thread(read_shape, entry.model_path)
    arch = shape.architecture
    info = {
        "general.architecture": arch,
        "general.name": shape.name,
        "general.parameter_count": shape.n_params,
        "general.file_type": shape.file_type,
        f"{arch}.context_length": shape.context_length,
        f"{arch}.block_count": shape.n_layer,
        f"{arch}.embedding_length": shape.embedding_length,
        f"{arch}.attention.head_count": shape.n_head,
        f"{arch}.attention.sliding_window": shape.sliding_window,
        f"{arch}.nextn_predict_layers": shape.n_nextn,
        f"{arch}.expert_count": shape.expert_count,
    }
    capabilities = ["completion"] + (["chat"] if shape.chat_template else [])
    return web.json_response({
        "license": "",
        "modelfile": f"FROM {entry.model_path}\n",
        "parameters": "",
        "template": shape.chat_template or "",
        "details": entry.details,
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": entry.modified_at,
    })


@routes.delete("/api/delete")
async def api_delete(request: web.Request) -> web.Response:
    body = await read_json(request)
    name = get_model_field(body)
    entry = find_model(request.app, name)
    await request.app[SCHEDULER].unload(str(entry.name))  # never delete a file in use
    request.app[STORE].remove(entry.name)
    return web.json_response({})


@routes.post("/api/import")
async def api_import(request: web.Request) -> web.Response:
    """A GGUF file on this machine into the store (what `localllm import` does without a
    daemon). The daemon runs as the user, so it reads only what the user could read."""
    body = await read_json(request)
    name = get_str(body, "model", required=True)
    path = get_str(body, "path", required=True)
    link = not get_bool(body, "copy", False)
    entry = await asyncio.to_thread(request.app[STORE].import_gguf, Path(path), name, link)
    return web.json_response(_model_json(entry))


@routes.post("/api/copy")
async def api_copy(request: web.Request) -> web.Response:
    body = await read_json(request)
    source = get_str(body, "source", required=True)
    destination = get_str(body, "destination", required=True)
    request.app[STORE].copy(source, destination)
    return web.json_response({})


@routes.get("/api/ps")
async def api_ps(request: web.Request) -> web.Response:
    models = []
    for slot in request.app[SCHEDULER].models.values():
        runner = slot.runner
        plan = runner.plan
        shape = slot.shape
        kv = int(shape.kv_bytes_per_token(*_kv_bytes(plan)) * runner.n_ctx * runner.n_parallel)
        size = slot.entry.model_layer.size + kv
        vram = plan.vram_bytes()
        models.append({
            **_model_json(slot.entry),
            "size": size,
            "size_vram": vram,
            "expires_at": FOREVER if slot.keep_alive is None else (
                iso(slot.expires_at) if slot.expires_at else iso(time.time() + slot.keep_alive)),
            "context_length": runner.n_ctx,
            # localllm additions
            "processor": processor(vram, size) if not plan.rpc_workers
            else rpc_processor(plan),
            "devices": device_split(plan),
            "kv_type": plan.type_k if plan.type_k == plan.type_v
            else f"{plan.type_k}/{plan.type_v}",
            "gpu_layers": plan.n_gpu_layers,
            "flash_attn": plan.flash_attn,
            "threads": plan.n_threads,
            "runner_pid": runner.pid,
            "busy": slot.busy,
            "num_parallel": runner.n_parallel,
            "active": slot.active,
            "plan_source": plan.source,
        })
    return web.json_response({"models": models})


def _kv_bytes(plan) -> tuple[float, float]:
    per = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
           "q5_0": 22 / 32, "q5_1": 24 / 32, "iq4_nl": 18 / 32}
    return per[plan.type_k], per[plan.type_v]


def processor(vram: int, size: int) -> str:
    """Ollama's PROCESSOR column: '100% GPU', '100% CPU' or '48%/52% CPU/GPU'."""
    if size <= 0 or vram <= 0:
        return "100% CPU"
    gpu = min(100, round(100 * vram / size))
    return "100% GPU" if gpu >= 100 else f"{100 - gpu}%/{gpu}% CPU/GPU"


def device_split(plan) -> list[dict]:
    """Where the layers are, device by device in llama.cpp's order, with the memory planned
    for each (weights and KV); empty for a plan that never said."""
    memory = {m.device: m.total for m in plan.memory}
    return [{"device": device, "layers": layers, "size": memory.get(device, 0)}
            for device, layers in plan.device_layers]


def rpc_processor(plan) -> str:
    """PROCESSOR for a plan with RPC workers: the share of planned bytes on each kind of
    device ('30%/70% CPU/RPC', '10%/40%/50% CPU/GPU/RPC')."""
    kinds: dict[str, int] = {}
    for m in plan.memory:
        kind = "CPU" if m.device == "CPU" else "RPC" if m.device.startswith("RPC") else "GPU"
        kinds[kind] = kinds.get(kind, 0) + m.total
    total = sum(kinds.values()) or 1
    used = [k for k in ("CPU", "GPU", "RPC") if kinds.get(k)]
    if len(used) == 1:
        return f"100% {used[0]}"
    return "/".join(f"{round(100 * kinds[k] / total)}%" for k in used) + " " + "/".join(used)
