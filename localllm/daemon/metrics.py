"""Prometheus metrics at GET /metrics (text format 0.0.4), behind the API's own access rules.

Counted as the daemon serves: requests by route and status (server.py's outermost middleware
bumps `requests`, so that a refused request counts too), and for each answer its prompt and
generated tokens, time to first token and decode speed (histograms) and drafts (Scheduler
hands every Done to `answered`).
Read when scraped: the queue and the answers in progress, each loaded model with its plan (GPU
layers, KV type, context, speculative mode), its VRAM (NVML's figure for its runner, else its
plan's) and its runner's RAM, its expert cache's hits, misses and swaps; the machine's GPU
memory (NVML), its RAM and the daemon's own.
No client library: the format is a few lines of text.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import time
from collections import Counter
from dataclasses import dataclass

from aiohttp import web
from localllm.engine import hardware, nvml
from localllm.engine.runner.protocol import Done

from .api.stats import GPU, process_rss, vram_of

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)  # seconds
DECODE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)  # tokens a second


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: +Inf only
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        sep = "," if labels else ""
        for bound, n in zip((*self.buckets, "+Inf"), self.counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {running}')
        out.append(f"{name}_sum{{{labels}}} {self.total:.6f}")
        out.append(f"{name}_count{{{labels}}} {running}")
        return out


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@dataclass(frozen=True)
class Machine:
    """What the machine has, read when scraped (NVML and /proc: in a thread)."""
    gpus: list[dict]  # nvml.devices(): [] without an NVIDIA GPU
    vram_by_pid: dict[int, int] | None  # NVML's per-process figure; None without a GPU
    ram_total: int
    ram_available: int
    daemon_rss: int

    @classmethod
    def read(cls, with_models: bool) -> Machine:
        return cls(nvml.devices(), GPU.by_pid() if with_models else None,
                   hardware.host_ram_bytes(), hardware.ram_available(),
                   process_rss(os.getpid()) or 0)


class Metrics:
    def __init__(self):
        self.started = time.time()
        self.requests: Counter[tuple[str, str, int]] = Counter()  # (method, route, status)
        self.prompt_tokens: Counter[str] = Counter()
        self.cached_tokens: Counter[str] = Counter()
        self.generated_tokens: Counter[str] = Counter()
        self.drafted: Counter[str] = Counter()
        self.accepted: Counter[str] = Counter()
        self.ttft: dict[str, Histogram] = {}
        self.decode: dict[str, Histogram] = {}

    def answered(self, model: str, done: Done) -> None:
        self.prompt_tokens[model] += done.prompt_tokens
        self.cached_tokens[model] += done.cached_tokens
        self.generated_tokens[model] += done.eval_count
        if done.drafted:
            self.drafted[model] += done.drafted
            self.accepted[model] += done.draft_accepted or 0
        self.ttft.setdefault(model, Histogram(TTFT_BUCKETS)).observe(
            done.prompt_eval_duration_ns / 1e9)
        if done.eval_count > 1 and done.eval_duration_ns > 0:
            self.decode.setdefault(model, Histogram(DECODE_BUCKETS)).observe(
                done.eval_count / (done.eval_duration_ns / 1e9))

    def render(self, scheduler, machine: Machine) -> str:
        out: list[str] = []

        def family(name: str, kind: str, text: str, samples: list[str]) -> None:
            out.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples])

        family("localllm_requests_total", "counter", "HTTP requests by route and status",
               [f'localllm_requests_total{{method="{m}",route="{_label(r)}",code="{s}"}} {n}'
                for (m, r, s), n in sorted(self.requests.items())])
        for name, counter, text in (
                ("localllm_prompt_tokens_total", self.prompt_tokens, "prompt tokens, whole"),
                ("localllm_prompt_cached_tokens_total", self.cached_tokens,
                 "prompt tokens reused from the cache, not read"),
                ("localllm_generated_tokens_total", self.generated_tokens, "tokens generated"),
                ("localllm_draft_tokens_total", self.drafted, "speculative tokens drafted"),
                ("localllm_draft_accepted_tokens_total", self.accepted,
                 "speculative tokens accepted")):
            family(name, "counter", text, [f'{name}{{model="{_label(m)}"}} {n}'
                                            for m, n in sorted(counter.items())])
        for name, hists, text in (
                ("localllm_time_to_first_token_seconds", self.ttft,
                 "prompt reading time of each answer"),
                ("localllm_decode_tokens_per_second", self.decode, "decode speed of each answer")):
            family(name, "histogram", text,
                   [line for m, h in sorted(hists.items())
                    for line in h.lines(name, f'model="{_label(m)}"')])
        family("localllm_queue_depth", "gauge", "requests waiting for a slot or a load",
               [f"localllm_queue_depth {scheduler.queued}"])
        loaded, active, vram, ram, cache = [], [], [], [], []
        for name, model in sorted(scheduler.models.items()):
            runner, m = model.runner, f'model="{_label(name)}"'
            plan = runner.running_plan
            loaded.append(f'localllm_model_loaded{{{m},gpu_layers="{plan.n_gpu_layers}",'
                          f'kv_type="{plan.type_k}/{plan.type_v}",context="{runner.n_ctx}",'
                          f'slots="{runner.n_parallel}",'
                          f'speculative="{_label(plan.speculative)}"}} 1')
            active.append(f"localllm_requests_in_progress{{{m}}} {model.active}")
            used, source = vram_of(runner.pid, machine.vram_by_pid, plan)
            vram.append(f'localllm_model_vram_bytes{{{m},source="{source or "plan"}"}} '
                        f'{plan.vram_bytes() if used is None else used}')
            ram.append(f"localllm_model_ram_bytes{{{m}}} {process_rss(runner.pid) or 0}")
            if runner.expert_cache is not None:
                ec = runner.expert_cache
                cache += [f'localllm_expert_cache_lookups_total{{{m},result="hit"}} {ec.hits}',
                          f'localllm_expert_cache_lookups_total{{{m},result="miss"}} '
                          f'{ec.misses}',
                          f"localllm_expert_cache_swaps_total{{{m}}} {ec.swaps}"]
        family("localllm_model_loaded", "gauge", "loaded models and their plan", loaded)
        family("localllm_requests_in_progress", "gauge",
               "requests holding one of the model's slots", active)
        family("localllm_model_vram_bytes", "gauge",
               "VRAM of the model's runner (source: nvml measured, else its plan's)", vram)
        family("localllm_model_ram_bytes", "gauge", "resident RAM of the model's runner", ram)
        family("localllm_expert_cache_lookups_total", "counter",
               "expert cache lookups by result", [c for c in cache if "lookups" in c])
        family("localllm_expert_cache_swaps_total", "counter", "experts copied into the pool",
               [c for c in cache if "swaps" in c])
        family("localllm_gpu_memory_bytes", "gauge", "each GPU's memory, total and free",
               [f'localllm_gpu_memory_bytes{{gpu="{g["index"]}",name="{_label(g["name"])}",'
                f'kind="{kind}"}} {g[kind]}' for g in machine.gpus for kind in ("total", "free")])
        family("localllm_host_memory_bytes", "gauge",
               "the machine's RAM, total and available to a model now",
               [f'localllm_host_memory_bytes{{kind="total"}} {machine.ram_total}',
                f'localllm_host_memory_bytes{{kind="available"}} {machine.ram_available}'])
        family("localllm_daemon_ram_bytes", "gauge", "resident RAM of the daemon itself",
               [f"localllm_daemon_ram_bytes {machine.daemon_rss}"])
        family("localllm_uptime_seconds", "gauge", "seconds since the daemon started",
               [f"localllm_uptime_seconds {time.time() - self.started:.1f}"])
        return "\n".join(out) + "\n"


METRICS = web.AppKey("metrics", Metrics)


routes = web.RouteTableDef()


@routes.get("/metrics")
async def get_metrics(request: web.Request) -> web.Response:
    from .state import SCHEDULER

    scheduler = request.app[SCHEDULER]
    machine = await asyncio.to_thread(Machine.read, bool(scheduler.models))
    return web.Response(text=request.app[METRICS].render(scheduler, machine),
                        content_type="text/plain", charset="utf-8",
                        headers={"X-Prometheus-Format": "0.0.4"})
