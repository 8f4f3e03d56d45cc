"""GET /api/stats: what each loaded model's runner really costs and did, for live displays.

Per loaded model: the runner's pid, its resident memory (from /proc), its GPU memory (NVML, per
process; `null` without a GPU), the plan it was loaded with (layer split, KV type, context) and
the counters of its last request, and its MoE expert cache's slots, hits, misses and swaps
(`expert_cache`, null without one; once it has MIN_LOOKUPS lookups, the plan's decode priced at
the hit rate it measured, `predicted_decode_by_depth`). Every figure is measured except where
`vram_source` says "plan": NVML cannot see the runner (another PID namespace), so the plan's
prediction stands in and clients should mark it as an estimate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from aiohttp import web
from localllm.engine import nvml
from localllm.planner.quality import kv_label

from ..state import SCHEDULER

routes = web.RouteTableDef()
log = logging.getLogger(__name__)


def process_rss(pid: int | None, proc: Path = Path("/proc")) -> int | None:
    """Resident set size of a process in bytes (mapped model pages it has touched included)."""
    if pid is None:
        return None
    try:
        text = (proc / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # the kernel writes kB
    return None


GPU = nvml.GpuMemory()


def kv_type(plan) -> str:
    return kv_label(plan.type_k, plan.type_v)


def plan_summary(plan, n_layer: int) -> dict:
    """The plan a runner was loaded with, as a client shows it. Layers count the output layer,
    as llama.cpp's "offloaded 31/31 layers to GPU" does."""
    n_all = n_layer + 1
    return {
        "gpu_layers": max(0, min(plan.n_gpu_layers, n_all)) if plan.n_gpu_layers >= 0 else n_all,
        "layers": n_all,
        "n_ctx": plan.n_ctx,
        "kv_type": kv_type(plan),
        "flash_attn": plan.flash_attn,
        "n_threads": plan.n_threads,
        "speculative": plan.speculative,
        "draft_n_max": plan.draft_n_max,
        "cpu_overrides": [o.pattern for o in plan.tensor_overrides],
        "predicted_vram": plan.vram_bytes(),
        "predicted_ram": plan.ram_bytes(),
        "predicted_prefill_tps": plan.predicted_prefill_tps,
        "predicted_decode_tps": plan.predicted_decode_tps,
        # (tokens in context, tok/s): the plan's decode at its start, middle and end
        "predicted_decode_by_depth": [list(point) for point in plan.predicted_decode_by_depth],
        "n_ubatch": plan.n_ubatch,
        "expert_cache": plan.expert_cache,
        "expert_misses_on_gpu": plan.expert_misses_on_gpu,
        "expert_cache_swaps": plan.expert_cache_swaps,
        "source": plan.source,
        "reasons": list(plan.reasons),
    }


def last_request(done) -> dict | None:
    if done is None:
        return None
    last = {
        "done_reason": done.done_reason,
        "prompt_eval_count": done.prompt_eval_count,
        "prompt_eval_duration": done.prompt_eval_duration_ns,
        "eval_count": done.eval_count,
        "eval_duration": done.eval_duration_ns,
        "prompt_tokens": done.prompt_tokens,
        "cached_tokens": done.cached_tokens,
        # where they came from: "slot", "checkpoint" (of the recurrent or sliding-window
        # state, at position `checkpoint`), "prompt cache" (RAM), "disk"; "" when nothing was
        # kept
        "cached_from": done.cached_from,
        "checkpoint": done.checkpoint,
    }
    if done.drafted is not None:
        last["draft"] = {"drafted": done.drafted, "accepted": done.draft_accepted or 0}
    return last


def expert_cache_report(plan, figures, at_hits=()) -> dict | None:
    """The MoE expert cache as the plan asked it and as the runner's context has it (figures:
    ExpertCacheStats as of the last answer, None where the engine made no pool); None for a
    plan that asked none and a runner that has none. `at_hits`: the plan's decode by depth
    with the pool priced at the measured hit rate (decode_at_measured_hits), where known."""
    if figures is None and not plan.expert_cache:
        return None
    report = {"planned_slots": plan.expert_cache, "on": figures is not None}
    if figures is not None:
        report.update(slots=figures.slots, layers=figures.layers, hits=figures.hits,
                      misses=figures.misses, hit_rate=round(figures.hit_rate, 4),
                      swaps=figures.swaps, steps=figures.steps, pool_bytes=figures.pool_bytes,
                      misses_on="gpu" if figures.misses_on_gpu else "cpu")
    if at_hits:
        report["predicted_decode_by_depth"] = [list(point) for point in at_hits]
    return report


async def decode_at_hits(scheduler, slot) -> tuple[tuple[int, float], ...]:
    """The running plan's decode by depth at its pool's measured hit rate, on this machine's
    card as the planner sees it; () before that is known. Priced in a thread (the card is
    probed) once per answer's figures (kept on the loaded model); a failure is logged and
    leaves the field out, never the whole report."""
    from localllm.profiles.expert_hits import MIN_LOOKUPS
    from localllm.profiles.pool_price import decode_at_measured_hits

    runner = slot.runner
    pool, plan = runner.expert_cache, runner.running_plan
    if pool is None or pool.hits + pool.misses < MIN_LOOKUPS:
        return ()
    if slot.priced_at_hits and slot.priced_at_hits[0] is plan \
            and slot.priced_at_hits[1] == pool:
        return slot.priced_at_hits[2]
    try:
        curve = await asyncio.to_thread(lambda: decode_at_measured_hits(
            plan, slot.shape, scheduler.planner.card(), pool))
    except Exception as e:  # a report must not fail over a price
        log.warning("could not price the plan at its measured hit rate: %s", e)
        return ()
    slot.priced_at_hits = (plan, pool, curve)
    return curve


def expert_cache_words(report: dict | None) -> str:
    """`expert cache: 16 slots, 62% hits` for ps; "" without one."""
    if report is None:
        return ""
    if not report["on"]:
        return (f"expert cache: {report['planned_slots']} slots planned, none made by "
                "llama.cpp (see the runner log)")
    lookups = report["hits"] + report["misses"]
    rate = f"{report['hit_rate']:.0%} hits of {lookups} lookups" if lookups else \
        "no lookups yet"
    return (f"expert cache: {report['slots']} slots, {rate}, {report['swaps']} swaps, "
            f"misses on the {report['misses_on'].upper()}")


def vram_of(pid: int | None, by_pid: dict[int, int] | None, plan) -> tuple[int | None, str | None]:
    """(bytes, source): measured by NVML, else the plan's figure where NVML cannot see the pid,
    else (None, None) on a machine without an NVIDIA GPU."""
    if by_pid is None:
        return None, None
    if pid in by_pid:
        return by_pid[pid], "nvml"
    return plan.vram_bytes(), "plan"


@routes.get("/api/stats")
async def api_stats(request: web.Request) -> web.Response:
    scheduler = request.app[SCHEDULER]
    slots = list(scheduler.models.items())
    by_pid = await asyncio.to_thread(GPU.by_pid) if slots else None
    models = []
    for name, slot in slots:
        runner = slot.runner
        layers = slot.shape.n_layer
        vram, vram_source = vram_of(runner.pid, by_pid, runner.running_plan)
        done = runner.last_done
        models.append({
            "model": name,
            "runner_pid": runner.pid,
            "busy": slot.busy,
            **runner.figures(),  # loaded_at, load_duration, context_length, tokens_generated
            "rss_bytes": process_rss(runner.pid),
            "vram_bytes": vram,
            "vram_source": vram_source,
            "plan": plan_summary(runner.running_plan, layers),
            **({"fill_band": runner.fill_band()} if runner.bands else {}),
            "context_used": done.context_used if done else 0,
            "expert_cache": expert_cache_report(runner.running_plan, runner.expert_cache,
                                                await decode_at_hits(scheduler, slot)),
            "last": last_request(done),
        })
    return web.json_response({"models": models, "time": time.time()})
