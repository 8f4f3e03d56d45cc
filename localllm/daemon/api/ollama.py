"""Ollama's native API (/api/*) as Ollama's api/types.go has it: the request fields its routes
share, /api/generate and /api/chat (the one `ChatRequest`, answered in NDJSON lines or one
object through the one response pipeline, respond.py) and what is loaded (/api/ps). The model
routes are ollama_models.py.

Durations on the wire are nanoseconds; `num_ctx` on the wire is `n_ctx` inside. An empty
prompt loads the model (with keep_alive 0 unloads it), as Ollama does.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import dataclass

from aiohttp import web
from localllm.engine.runner.protocol import Done, Token
from localllm.modelstore.names import BadModelName, parse_name
from localllm.modelstore.store import ModelEntry
from localllm.planner.memory import kv_element_bytes
from localllm.planner.quality import kv_label

from localllm.config import ConfigError, parse_duration
from localllm.options import LoadOptions, SamplingOptions

from localllm.modelstore.custom import Customization
from ..chat.parse import Parsed
from ..chat.request import THINK_LEVELS, ChatRequest
from localllm.engine.runner.protocol import new_request_id
from ..state import SCHEDULER, aliases_json
from .common import (
    bad_request,
    customization,
    find_model,
    get_bool,
    get_messages,
    get_number,
    get_prompt_images,
    get_str,
    get_tool_choice,
    get_tools,
    has_images,
    parse_options,
    read_json,
)
from .respond import Generation, Part, Writer, hold, respond
from .stats import expert_cache_report, expert_cache_words, process_rss

routes = web.RouteTableDef()
NDJSON = "application/x-ndjson"  # Ollama streams one JSON object a line
FOREVER = "2318-08-12T00:00:00Z"
STARTED_AT = time.time()  # what Ollama reports for a model kept loaded forever
OLLAMA_API_LEVEL = "0.12.10"  # the Ollama release whose API these routes follow


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


# ---- request fields -----------------------------------------------------------------------
def ollama_options(body: dict, stored: dict | None = None
                   ) -> tuple[SamplingOptions, LoadOptions]:
    """Ollama `options` (the table's names) over a Modelfile's stored PARAMETERs."""
    values = body.get("options") or {}
    if not isinstance(values, dict):
        raise bad_request("field 'options' must be an object", "options")
    return parse_options(values, stored=stored)


def parse_keep_alive(body: dict):
    value = body.get("keep_alive")
    if value is None:
        return "default"
    try:
        return parse_duration(value)
    except ConfigError as e:
        raise bad_request(str(e), "keep_alive") from None


# ---- models ----------------------------------------------------------------------------------
def model_json(entry) -> dict:
    return {"name": entry.name.tagged, "model": entry.name.tagged, "modified_at": entry.modified_at,
            "size": entry.size, "digest": entry.manifest_digest.removeprefix("sha256:"),
            "details": entry.details}


@dataclass(frozen=True)
class Common:
    """What /api/generate and /api/chat share, parsed once: the model, the sampling options,
    the load options (num_ctx and the rest) and how to answer."""

    entry: ModelEntry
    sampling: SamplingOptions
    load: LoadOptions
    keep_alive: float | None | str
    stream: bool
    custom: Customization


async def parse_common(request: web.Request, body: dict) -> Common:
    entry = find_model(request, get_str(body, "model", required=True))
    custom = await customization(request, entry)
    sampling, load = ollama_options(body, custom.parameters)
    return Common(entry=entry, sampling=sampling, load=load,
                  keep_alive=parse_keep_alive(body), stream=get_bool(body, "stream", True),
                  custom=custom)


def metrics(gen: Generation, done: Done) -> dict:
    return {
        "done_reason": done.done_reason,
        "total_duration": gen.total_duration_ns(),
        "load_duration": gen.load_duration_ns,
        # As Ollama: the whole input, and beside it the part reused from the KV cache (the
        # duration is the rest's: the tokens actually read).
        "prompt_eval_count": done.prompt_tokens,
        "prompt_eval_cached_count": done.cached_tokens,
        "prompt_eval_duration": done.prompt_eval_duration_ns,
        "eval_count": done.eval_count,
        "eval_duration": done.eval_duration_ns,
        # localllm additions (clients that do not know them ignore them)
        "prompt_tokens": done.prompt_tokens,
        "context_used": done.context_used,
        "context_length": done.n_ctx,
        # the prompt's tokens left out to fit the context (`truncate`, Ollama's default)
        **({"prompt_truncated_count": done.prompt_truncated} if done.prompt_truncated else {}),
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
    if isinstance(event, Done):  # the part of the prompt reused: a regenerate's is nearly all
        stats["prompt_eval_cached_count"] = event.cached_tokens
    if event.drafted is not None:  # only while speculative decoding is on
        stats["draft"] = {"drafted": event.drafted, "accepted": event.draft_accepted or 0}
    return stats


# ---- generate and chat -----------------------------------------------------------------
def get_think(body: dict):
    """`think`: absent/null, true/false, or an effort level (Zed sends null, LiteLLM levels)."""
    value = body.get("think")
    if value is None or isinstance(value, bool) or value in THINK_LEVELS:
        return value
    raise bad_request('field \'think\' must be true, false, "low", "medium" or "high"', "think")


def get_format(body: dict):
    value = body.get("format")
    if value in (None, "", "json") or isinstance(value, dict):
        return value
    raise bad_request(f'invalid format: {json.dumps(value)[:80]}; expected "json" or a valid '
                      f"JSON Schema object", "format")


def tool_calls_json(parsed: Parsed) -> list[dict]:
    """Ollama's shape: arguments as an object, an id, and the call's index."""
    return [{"id": call.id, "function": {"index": call.index, "name": call.name,
                                         "arguments": call.arguments}}
            for call in parsed.tool_calls]


def chat_fields(parsed: Parsed) -> dict:
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.thinking:
        message["thinking"] = parsed.thinking
    if parsed.tool_calls:
        message["tool_calls"] = tool_calls_json(parsed)
    return {"message": message}


def generate_fields(parsed: Parsed) -> dict:
    fields: dict = {"response": parsed.content}
    if parsed.thinking:
        fields["thinking"] = parsed.thinking
    return fields


class OllamaWriter(Writer):
    """Ollama's answer to /api/chat (a `message`) and /api/generate (a `response`): NDJSON, one
    object a line, as it streams; or one object."""

    headers = {"Content-Type": NDJSON}

    def __init__(self, model: str, chat: ChatRequest, shape, final_extra):
        self.model, self.logprobs = model, chat.logprobs is not None
        self.shape, self.final_extra = shape, final_extra
        self.ttft_ns = 0  # request received -> first answer text, set at the first token

    def whole(self, parsed: Parsed, done: Done, logprobs: list[dict]) -> dict:
        run = self.run
        extra = {"logprobs": logprobs} if self.logprobs else {}
        return {"model": self.model, "created_at": now_iso(), **self.shape(parsed),
                "done": True, **self.final_extra(done), **metrics(run.gen, done), **extra,
                **run.truncation(), "stats": live_stats(done, done.n_ctx, run.first_token_ns)}

    def _line(self, parsed: Parsed, **fields) -> dict:
        return {"model": self.model, "created_at": now_iso(), **self.shape(parsed),
                "done": False, **fields}

    async def _send(self, *lines: dict) -> None:
        await self.write(b"".join(json.dumps(line).encode() + b"\n" for line in lines))

    async def part(self, part: Part) -> None:
        event, gen = part.event, self.run.gen
        if isinstance(event, Token):
            self.ttft_ns = self.ttft_ns or gen.total_duration_ns()
            line = self._line(part.parsed, stats=live_stats(event, gen.runner.n_ctx,
                                                            self.ttft_ns))
            if self.logprobs:
                line["logprobs"] = part.logprobs
        else:  # a long prompt is being read (localllm addition)
            line = self._line(Parsed(), progress={
                "prompt_read": event.prompt_read, "prompt_total": event.prompt_total,
                **({"note": event.note} if event.note else {})})
        await self._send(line)

    async def done(self, part: Part) -> None:
        done, run = part.event, self.run
        tail = [self._line(part.parsed)] if part.parsed else []  # a call, a held-back tail
        await self._send(*tail, {
            **self._line(Parsed()), "done": True, **self.final_extra(done),
            **metrics(run.gen, done), **run.truncation(),
            "stats": live_stats(done, done.n_ctx, self.ttft_ns)})

    async def error(self, message: str) -> None:
        await self._send({"error": message})


async def _respond(request: web.Request, common: Common, chat: ChatRequest, shape,
                   final_extra, truncate: bool = True) -> web.StreamResponse:
    writer = OllamaWriter(common.entry.name.tagged, chat, shape, final_extra)
    # Ollama's `truncate`: the oldest turns dropped, then the prompt's oldest tokens
    return await respond(request, chat, writer, entry=common.entry, custom=common.custom,
                         stream=common.stream, keep_alive=common.keep_alive,
                         truncate=truncate, cut_tokens=truncate)


def get_logprobs(body: dict) -> int | None:
    """Ollama's `logprobs: true` with `top_logprobs: N` (0-20): None when not asked."""
    if not get_bool(body, "logprobs", False):
        return None
    return get_number(body, "top_logprobs", int, 0, 20) or 0


def _chat_request(common: Common, body: dict, **fields) -> ChatRequest:
    return ChatRequest(id=new_request_id(), model_name=common.entry.name.tagged,
                       options=common.sampling, load=common.load, format=get_format(body),
                       think=get_think(body), has_images=has_images(body),
                       logprobs=get_logprobs(body), **fields)


@routes.post("/api/generate")
async def api_generate(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    prompt = get_str(body, "prompt", default="")
    suffix = get_str(body, "suffix")
    raw = get_bool(body, "raw", False)
    common = await parse_common(request, body)
    if not prompt and not suffix:
        return await _load_only(request, common)
    if raw and (body.get("template") or body.get("system") or body.get("context")):
        raise bad_request("raw mode does not take a template, system or context", "raw")
    images: list = []
    prompt = get_prompt_images(body, images) + prompt
    chat = _chat_request(common, body, prompt=prompt, system=get_str(body, "system"),
                         suffix=suffix or None, raw=raw, images=tuple(images))
    return await _respond(request, common, chat, generate_fields,
                          lambda done: {"context": list(done.context)},
                          truncate=get_truncate(body))


@routes.post("/api/chat")
async def api_chat(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    common = await parse_common(request, body)
    if body.get("messages") in (None, []):
        return await _load_only(request, common)
    images: list = []
    chat = _chat_request(common, body, messages=get_messages(body, images),
                         tools=get_tools(body), tool_choice=get_tool_choice(body),
                         images=tuple(images))
    return await _respond(request, common, chat, chat_fields, lambda done: {},
                          truncate=get_truncate(body))


def get_truncate(body: dict) -> bool:
    """`options.truncate` (or top-level `truncate`): false refuses a chat longer than the
    context instead of dropping its oldest turns."""
    options = body.get("options") if isinstance(body.get("options"), dict) else {}
    value = options.get("truncate", body.get("truncate", True))
    if not isinstance(value, bool):
        raise bad_request("field 'truncate' must be true or false", "truncate")
    # Ollama's `shift` (move the context when the answer fills it): accepted; here an answer
    # that fills the context ends with done_reason "length" either way
    shift = options.get("shift", body.get("shift", True))
    if not isinstance(shift, bool):
        raise bad_request("field 'shift' must be true or false", "shift")
    return value


async def _load_only(request: web.Request, common: Common) -> web.Response:
    """An empty prompt loads the model; with keep_alive 0 it unloads it (`ollama stop`)."""
    app, entry = request.app, common.entry
    key = "message" if request.path == "/api/chat" else "response"
    empty = {"role": "assistant", "content": ""} if key == "message" else ""
    if common.keep_alive == 0:
        await app[SCHEDULER].unload(entry.name.tagged)
        reason = "unload"
    else:
        async with hold(app, entry, common.load, common.keep_alive):
            pass  # a remote model is always ready: its upstream loads it
        reason = "load"
    return web.json_response({"model": entry.name.tagged, "created_at": now_iso(), key: empty,
                              "done": True, "done_reason": reason})


# ---- what is loaded ---------------------------------------------------------------------------
@routes.post("/api/crashes/forget")
async def forget_crashes(request: web.Request) -> web.Response:
    """Drop what the plans of `model` (of every model, without one) leave off because its
    runners crashed (daemon/crashes.py): its next load runs the plan as made."""
    body = await read_json(request) if request.can_read_body else {}
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise bad_request("field 'model' must be a model name", "model")
        try:
            model = parse_name(model).tagged
        except BadModelName as e:
            raise bad_request(str(e), "model") from None
    return web.json_response({"forgotten": request.app[SCHEDULER].crashes.forget(model)})


@routes.get("/api/ps")
async def api_ps(request: web.Request) -> web.Response:
    models = []
    for slot in request.app[SCHEDULER].models.values():
        runner = slot.runner
        plan = runner.running_plan  # the fill band's plan that runs now
        shape = slot.shape
        per_token = shape.kv_bytes_per_token(kv_element_bytes(plan.type_k),
                                             kv_element_bytes(plan.type_v))
        kv = int(per_token * plan.n_ctx * runner.n_parallel)
        size = slot.entry.model_layer.size + kv
        vram = plan.vram_bytes()
        models.append({
            **model_json(slot.entry),
            "size": size,
            "size_vram": vram,
            "expires_at": FOREVER if slot.keep_alive is None else (
                iso(slot.expires_at) if slot.expires_at else iso(time.time() + slot.keep_alive)),
            "context_length": runner.n_ctx,
            # localllm additions
            "processor": processor(vram, size) if not plan.rpc_workers
            else rpc_processor(plan),
            "devices": device_split(plan),
            "kv_type": kv_label(plan.type_k, plan.type_v),
            "gpu_layers": plan.n_gpu_layers,
            "flash_attn": plan.flash_attn,
            "threads": runner.n_threads,  # in use: fewer than planned on a busy CPU
            "planned_threads": plan.n_threads,
            "threads_reason": runner.threads_reason,
            "runner_pid": runner.pid,
            # what the runner process holds in RAM, measured: beside SIZE (the plan's weights
            # and KV), which leaves out llama.cpp's buffers, the prompt cache and Python
            "rss_bytes": process_rss(runner.pid),
            "busy": slot.busy,
            "num_parallel": runner.n_parallel,
            "active": slot.active,
            "plan_source": plan.source,
            # where the choices came from: the request's options, the daemon's settings, a
            # saved profile (and why one was not used), the tuner
            "plan_reasons": list(plan.reasons),
            # off: the engine crashed with them loading this model, or is built with AMX on
            # an AMX CPU (plan_reasons says which)
            "extra_bufts": plan.extra_bufts,
            # what the plan leaves off because this model's runner crashed (daemon/crashes)
            **({"crash_note": note} if (note := request.app[SCHEDULER].crashes.note(
                slot.entry.name.tagged)) else {}),
            # as loaded: "mapped", "pinned in place" or "copied" (a refused pin copies them)
            "weights_in_ram": runner.weights_in_ram,
            "pin_in_place": plan.pin_in_place,  # what the plan asked for them
            # the session the running plan is made for, and where that came from
            **({"workload": {"planned_for": plan.workload,
                             "source": plan.workload_source or runner.plan.workload_source}}
               if plan.workload else {}),
            **({"fill_band": runner.fill_band()} if runner.bands else {}),
            # decode as served beside the running plan's prediction for the same answers
            # (profiles/served.py; answers that shared the runner are left out)
            **({"decode": slot.speed.report()} if slot.speed and slot.speed.tokens else {}),
            # the ways `auto` weighed for the experts, priced and as measured here (planner/ways)
            **({"ways": {"running": plan.way, "weighed": [
                {"way": w, "predicted_tps": p, "measured_tps": m} for w, p, m in plan.ways]}}
               if plan.ways else {}),
            # why it is planned again once idle (a price or a way to measure), until it is
            **({"replan": slot.replan} if slot.replan else {}),
            **({"past_ram": runner.past_ram} if runner.past_ram else {}),
            **({"expert_cache": {**cache, "text": expert_cache_words(cache)}}
               if (cache := expert_cache_report(plan, runner.expert_cache)) else {}),
            **({"projector": {"device": "GPU" if plan.projector_on_gpu else "CPU",
                              "seconds_per_image": round(plan.predicted_image_s, 3)}}
               if runner.projector_path else {}),
        })
    return web.json_response({"models": models, **aliases_json(request.app)})


def processor(vram: int, size: int) -> str:
    """Ollama's PROCESSOR column: '100% GPU', '100% CPU' or '48%/52% CPU/GPU'."""
    if size <= 0 or vram <= 0:
        return "100% CPU"
    gpu = min(100, round(100 * vram / size))
    return "100% GPU" if gpu >= 100 else f"{100 - gpu}%/{gpu}% CPU/GPU"


def device_split(plan) -> list[dict]:
    """Where the layers are, device by device in llama.cpp's order, with the memory planned
    for each (weights and KV); empty for a plan that never said."""
    memory = {m.device: m for m in plan.memory}
    return [{"device": device, "layers": layers,
             **({"size": m.total, "weights": m.weights, "kv": m.kv, "compute": m.compute,
                 "overhead": m.overhead} if (m := memory.get(device)) else {"size": 0})}
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
