"""The daemon's entry points: which plan to load a model with, and what to try after an OOM.

    choose_plan(shape, model_name, n_ctx, load, card) -> Plan
    step_down(plan, shape, card) -> Plan | None

`choose_plan` probes the machine, uses the saved profile for (card, model) when there is a valid
one, else runs the tuner; on a GPU it checks the tuner's compute-buffer estimate with a dry-run
load (cached) and re-plans when llama.cpp needs more. Ollama load options (num_gpu,
num_thread, num_batch) override the matching plan fields. A broken profile is reported in the
plan's reasons and the log, and the tuner plans instead.
"""

from __future__ import annotations

import logging
import os
from dataclasses import fields, replace

from localllm.config import Config, ConfigError, load_config_sources, parse_size
from localllm.modelstore.shape import ModelShape
from localllm.options import LoadOptions

from localllm.planner.card import MIB, Card
from localllm.planner.costs import model_costs
from localllm.planner.expert_pool import AUTO_SLOTS
from localllm.planner.memory import CPU, ComputeTable, ContextSettings, memory_by_device
from localllm.planner.placements import Placement, placement_of_overrides
from localllm.planner.plan import Plan
from localllm.planner.quality import kv_label
from localllm.planner.search import MIN_DEFAULT_CTX, NoPlanFits, Request
from localllm.planner.tuner import tune
from localllm.planner.workload import from_fill
from .acceptance import measured_acceptance
from .dryrun import dry_run, with_pool_bound
from .eval_results import measured_kl
from .expert_hits import measured_hits
from .ways import measured_ways
from .saved import ProfileError, find_profile, record_event
from .traffic import starting_workload

log = logging.getLogger(__name__)
DRY_RUN_ROUNDS = 3


def request_from_load(n_ctx: int | None, load: LoadOptions, margin_bytes: int,
                      base: Request | None = None) -> Request:
    """A request's load options as a tuner request, on top of `base` (the config's tuner
    settings). Options left to the tuner are None in `load` already (localllm/options.py)."""
    return replace(base or Request(), n_ctx=n_ctx, margin_bytes=margin_bytes,
                   n_gpu_layers=load.num_gpu, n_threads=load.num_thread, n_batch=load.num_batch)



def tuning_config(config: Config | None = None) -> tuple[Config | None, bool]:
    """The settings the tuner plans with: the daemon's live `Config` as it was handed, or where
    none is (`localllm tune`, `pull`), config.toml read now (None where it is unreadable:
    tuner defaults); and whether the older expected_fill was set (in the file or the
    environment; for a live Config: set to other than its default)."""
    if config is not None:
        return config, config.expected_fill != Config.expected_fill
    try:
        config, sources = load_config_sources()
    except ConfigError as e:
        log.warning("config not readable, tuner defaults used: %s", e)
        return None, False
    return config, sources["expected_fill"] != "default"


def config_request(model_name: str | None = None, file_size: int = 0,
                   hint: str | None = None, config: Config | None = None) -> Request:
    """The config's tuner settings (quality, kv_cache_type, num_parallel, vram_margin_mib,
    ram_budget, expert_cache, expert_misses, expert_cache_device), the workload (learned from
    what the model served, else the config's or the route's `hint`: profiles.traffic; the
    older expected_fill where set), the model's `localllm eval` results, and the draft
    acceptance, expert pool hits and ways' decode measured while serving it, as a Request.
    `config`: the daemon's live settings (None: config.toml, see tuning_config)."""
    config, fill_set = tuning_config(config)
    if config is None:
        return Request(num_parallel=None)
    pinned = None if config.kv_cache_type == "auto" else (config.kv_cache_type,)
    if fill_set:
        # expected_fill, where a user set it, keeps meaning what it did: one answer filling it
        workload = from_fill(config.expected_fill)
        source = f"config (expected_fill = {config.expected_fill:g})"
    else:
        workload, source = starting_workload(config.workload, model_name, hint)
    converted = dict(  # the settings the Request takes in other units or words, and the records
        margin_bytes=config.vram_margin_mib * MIB,
        kv_types=pinned,
        workload=workload,
        workload_source=source,
        ram_budget_bytes=parse_size(config.ram_budget),
        num_parallel=None if config.num_parallel == "auto" else int(config.num_parallel),
        measured_kl=measured_kl(model_name, file_size) if model_name else {},
        acceptance=measured_acceptance(model_name, file_size) if model_name else {},
        min_ctx=config.default_ctx,
        expert_cache=asked_pool(config.expert_cache),
        measured_hits=measured_hits(model_name, file_size) if model_name else (),
        measured_ways=measured_ways(model_name, file_size) if model_name else {},
    )
    as_set = {name: getattr(config, name) for name in same_names() if name not in converted}
    return Request(**as_set, **converted)


def same_names() -> tuple[str, ...]:
    """The tuner settings the Request names as the config does. Those it takes as they are set
    (quality, expert_misses, expert_cache_device...) pass with no line of their own in
    `config_request`: a new tuner setting is a Config field and a Request field of one name."""
    config_names = {f.name for f in fields(Config)}
    return tuple(f.name for f in fields(Request) if f.name in config_names)


def asked_pool(setting: int | str) -> int:
    """The config's expert_cache as the Request's: 0 off, AUTO_SLOTS auto, else N slots."""
    if setting == "off":
        return 0
    return AUTO_SLOTS if setting == "auto" else int(setting)


def gpus_setting(config: Config | None = None) -> str:
    """The config's gpus (`all`, or indices such as 0,1) that the probe keeps."""
    config, _ = tuning_config(config)
    return config.gpus if config is not None else "all"


def apply_options(plan: Plan, request: Request) -> Plan:
    changes = {}
    if request.n_gpu_layers is not None:
        changes["n_gpu_layers"] = request.n_gpu_layers
    if request.n_threads is not None:
        changes["n_threads"] = request.n_threads
    if request.n_batch is not None:
        changes["n_batch"] = request.n_batch
        changes["n_ubatch"] = min(plan.n_ubatch, request.n_batch)
    if not changes:
        return plan
    said = ", ".join(f"{k}={v}" for k, v in changes.items())
    return replace(plan, **changes, reasons=(*plan.reasons, f"from the request's options: {said}"))


def settings_over_profile(plan: Plan, request: Request) -> str:
    """Why the daemon's settings overrule a saved profile's plan ("" where they agree): a KV
    type or a number of slots that the env or config pins, and the profile does otherwise."""
    kv = kv_label(plan.type_k, plan.type_v)
    if request.kv_types and kv not in request.kv_types:
        return (f"the daemon's kv_cache_type ({', '.join(request.kv_types)}) comes before the "
                f"profile's {kv}")
    if request.num_parallel is not None and plan.n_parallel > request.num_parallel:
        return (f"the daemon's num_parallel ({request.num_parallel}) comes before the "
                f"profile's {plan.n_parallel}")
    return ""


def choose_plan(shape: ModelShape, model_name: str, n_ctx: int | None, load: LoadOptions,
                card: Card, draft_shape: ModelShape | None = None,
                hint: str | None = None, config: Config | None = None) -> Plan:
    """The plan the daemon loads `model_name` with on `card` (probed by the caller:
    engine/hardware.py); raises NoPlanFits (a UserError) when the model cannot run at that
    context on this machine. `draft_shape`: the draft model paired with it in the catalog,
    which the tuner may plan speculative decoding with. `hint`: what the request that loads it
    says of its session (profiles.traffic.route_hint). `config`: the daemon's live
    settings (None: config.toml)."""
    settings, _ = tuning_config(config)
    base = config_request(model_name, shape.file_size, hint, settings)
    request = request_from_load(n_ctx, load, base.margin_bytes, base)
    workers = settings.rpc_workers if settings is not None else ()
    if workers:  # other machines' devices too: profiles.rpc_plan (no saved profiles)
        from .rpc_plan import plan_for_workers

        plan = plan_for_workers(shape, card, request, workers, tune_checked)
        return apply_options(plan, replace(request, n_gpu_layers=None))
    notes: list[str] = []
    try:
        saved = find_profile(model_name, card.name)
    except ProfileError as e:
        log.warning("ignoring saved profile: %s", e)
        notes.append(f"saved profile ignored: {e}")
        saved = None
    if saved is not None:
        wrong_file = saved.model_size and saved.model_size != shape.file_size
        # Without num_ctx, a profile smaller than a raised default_ctx is not what was asked.
        floor = min(request.min_ctx, shape.context_length or request.min_ctx)
        wrong_ctx = n_ctx != saved.plan.n_ctx if n_ctx is not None \
            else request.min_ctx > MIN_DEFAULT_CTX and saved.plan.n_ctx < floor
        # The daemon's own settings come before a saved profile: one that pins the KV type or
        # the slots otherwise is set aside for this load, and the plan says so (ps, /show plan)
        overruled = settings_over_profile(saved.plan, request)
        if not wrong_file and not wrong_ctx and not overruled \
                and (card.has_gpu or saved.plan.n_gpu_layers == 0):
            return apply_options(saved.plan, request)
        notes.append(f"saved profile {saved.path} not used: "
                     + ("it was tuned for another file" if wrong_file
                        else f"it is for context {saved.plan.n_ctx}, asked {n_ctx or floor}"
                        if wrong_ctx else overruled if overruled
                        else "it puts layers on a GPU this machine lacks"))
    plan = tune_checked(shape, card, request, draft=draft_shape)
    return replace(plan, reasons=(*plan.reasons, *notes)) if notes else plan


def tune_checked(shape: ModelShape, card: Card, request: Request,
                 measure: bool | None = None, draft: ModelShape | None = None) -> Plan:
    """The tuner's plan with its compute buffers checked by dry-run loads of llama.cpp.

    The formula's error at the measured point (either sign) corrects it everywhere, the search
    runs again, and the new plan is measured in turn, until the plan found is one measured
    exactly. `measure` defaults to a probed card only: a profile planned on another machine has
    nothing here to measure."""
    plan = tune(shape, card, request, draft=draft)
    if measure is None:
        measure = card.source == "probe"
    if not card.has_gpu or not measure or not os.path.isfile(shape.path):
        return plan
    costs = model_costs(shape)
    table = ComputeTable({})
    for _ in range(DRY_RUN_ROUNDS):
        settings = settings_of(plan)
        placement = placement_of(plan, shape)
        key = ComputeTable.key(settings, placement)
        if key in table.measured:
            break
        result = dry_run(shape.path, plan)
        if result is None:
            return plan
        compute = dict(result.compute)
        if not any(d != CPU for d in compute):
            return plan  # a CPU build of llama.cpp: it says nothing about the GPU's buffers
        compute = with_pool_bound(compute, plan, costs, placement, settings, card)
        formula = {m.device: m.compute for m in memory_by_device(costs, placement, settings, card)}
        gpu_fix = max((compute.get(d, 0) - v for d, v in formula.items() if d != CPU), default=0)
        host_fix = compute.get(CPU, 0) - formula.get(CPU, 0)
        table = ComputeTable({**table.measured, key: compute}, gpu_fix, host_fix)
        plan = tune(shape, card, request, table, draft=draft)
    return replace(plan, reasons=(*plan.reasons,
                                  "compute buffers measured by dry-run loads of llama.cpp"))


def settings_of(plan: Plan) -> ContextSettings:
    # the runner's recurrent-state snapshots, by the same rule as engine.params
    return ContextSettings(plan.n_ctx, plan.type_k, plan.type_v, plan.flash_attn, plan.n_ubatch,
                           plan.swa_full, plan.n_parallel, n_rs_seq=plan.rollback_positions())


def placement_of(plan: Plan, shape: ModelShape) -> Placement:
    """The tuner's placement behind a plan's load parameters: each kind reads its own tensor
    override back (a saved profile's, edited or not, included)."""
    # local GPUs' layer counts (an RPC plan's tensor_split counts over the workers too)
    split = () if plan.rpc_workers else tuple(int(k) for k in plan.tensor_split)
    return placement_of_overrides(plan.n_gpu_layers, plan.tensor_overrides, split)


def step_down(plan: Plan, shape: ModelShape, card: Card, model_name: str | None = None,
              error: str = "out of memory", draft_shape: ModelShape | None = None,
              config: Config | None = None) -> Plan | None:
    """After a load ran out of memory: the best plan that needs clearly less VRAM (at least
    512 MiB or 10% less than `plan` was predicted to use), all-CPU as the last step, then None.
    With `model_name`, the step is recorded in the saved profile's history."""
    if not card.has_gpu or (plan.n_gpu_layers == 0 and not plan.tensor_overrides):
        return None
    used = plan.vram_bytes() or card.free_vram_bytes
    step = max(512 * MIB, used // 10)
    # A margin that leaves at most (used - step) for the plan on each GPU.
    margin = max(0, card.free_vram_bytes - (used - step) // max(1, card.n_gpus))
    request = replace(config_request(model_name, shape.file_size, config=config), n_ctx=plan.n_ctx,
                      margin_bytes=margin, n_threads=plan.n_threads,
                      num_parallel=plan.n_parallel)
    # A step down never grows the micro-batch: its compute buffer is VRAM too.
    smaller_ub = tuple(u for u in request.ubatch_sizes if u <= plan.n_ubatch)
    request = replace(request, ubatch_sizes=smaller_ub or (min(request.ubatch_sizes),))
    try:
        smaller = tune(shape, card, request, draft=draft_shape)
    except NoPlanFits:
        try:  # the last step: every layer on the CPU
            smaller = tune(shape, card, replace(request, n_gpu_layers=0, margin_bytes=0))
        except NoPlanFits:
            return None
    what = (f"{error} with n_gpu_layers={plan.n_gpu_layers}, {plan.type_k} KV at "
            f"{plan.n_ctx}; stepped down to n_gpu_layers={smaller.n_gpu_layers}, "
            f"{smaller.type_k} KV")
    smaller = replace(smaller, reasons=(*smaller.reasons, what), source="step-down")
    if model_name:
        record_event(model_name, card.name, what, smaller, model_size=shape.file_size)
    return smaller
