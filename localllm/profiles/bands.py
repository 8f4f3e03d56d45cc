"""Plans per fill band: a model loads with the plan of a smaller context first and moves up.

Less KV on the GPU leaves room for more of the weights, so while a context is short a smaller
band's plan decodes faster; when a sequence is about to outgrow its band, the runner reloads
with the next band's plan and carries every sequence's KV over (engine/runner/bands.py).

    band_plans(shape, card, request)            the tuner's plan per band, then the whole one
    choose_bands(shape, name, load, card, plan) the bands the daemon loads (config fill_bands)
                                                and the whole context's plan beside them

Each band is planned for the prompt that enters it (planner.workload): the first for
the short requests a runner starts with, the others for the long prompt that moves it up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from localllm.modelstore.shape import ModelShape

from localllm.config import Config, parse_bands
from localllm.options import LoadOptions

from localllm.planner.card import Card
from localllm.planner.plan import Plan
from localllm.planner.quality import kv_label
from localllm.planner.search import NoPlanFits, Request
from localllm.planner.tuner import tune
from .choose import apply_options, config_request, request_from_load, tune_checked, tuning_config

FILL_BANDS = (8192, 32768)  # plans per fill band: up to each of these, then the whole context


def band_plans(shape: ModelShape, card: Card, request: Request, n_ctx: int | None = None,
               whole_plan: Plan | None = None, sizes: tuple[int, ...] = FILL_BANDS,
               tuned: Callable[[ModelShape, Card, Request], Plan] | None = None,
               ) -> list[tuple[int, Plan]]:
    """A plan per fill band, each for the prompt that enters it: the first band for the short
    requests that start in it (Workload.in_band), each band above for the long prompt that
    moves a runner into it and the turns after (Workload.entering), with less KV (more on the
    GPU) than the whole context's; then the whole context's plan, for the prompt that enters it
    past the last band. `whole_plan` (default: tuned here for the whole workload) is the plan
    without bands: it sets what a runner carries KV across, so every band has its slots, KV
    types and drafting (llama.cpp restores a sequence's state only into a context with the same
    ones). `tuned` plans one band (default `tune`; the daemon's checks compute buffers with dry
    runs)."""
    tuned = tuned or (lambda shape, card, request: tune(shape, card, request))
    whole = whole_plan or tuned(shape, card, replace(request, n_ctx=n_ctx or request.n_ctx))
    pinned = replace(request, num_parallel=whole.n_parallel,
                     kv_types=(kv_label(whole.type_k, whole.type_v),))
    below = [b for b in sizes if b < whole.n_ctx]
    out = []
    for k, band in enumerate(below):
        workload = request.workload.in_band(band) if k == 0 \
            else request.workload.entering(below[k - 1], band)
        plan = _pinned_plan(shape, card, replace(pinned, n_ctx=band, workload=workload,
                                                 first_prompt_waits=k > 0), whole,
                            tuned, f"fill band: up to {band} tokens; a sequence that needs "
                            "more moves the runner to the next band's plan")
        if plan is not None:
            out.append((band, plan))
    entered = None
    if out:
        entered = _pinned_plan(shape, card, replace(
            pinned, n_ctx=whole.n_ctx, workload=request.workload.entering(below[-1], whole.n_ctx),
            first_prompt_waits=True),
            whole, tuned, f"the whole context's band, planned for the prompt that moves a "
            f"runner past {below[-1]} tokens into it")
    out.append((whole.n_ctx, entered or whole))
    return out


def _pinned_plan(shape: ModelShape, card: Card, request: Request, whole: Plan,
                 tuned: Callable[[ModelShape, Card, Request], Plan], why: str) -> Plan | None:
    """A band's plan with the whole plan's slots and drafting; None where none fits."""
    try:
        plan = tuned(shape, card, request)
    except NoPlanFits:
        return None
    if plan.n_parallel != whole.n_parallel:
        return None
    return replace(plan, speculative=whole.speculative, draft_n_max=whole.draft_n_max,
                   reasons=(*plan.reasons, why))


def choose_bands(shape: ModelShape, model_name: str, load: LoadOptions, card: Card,
                 plan: Plan, setting: str = "auto", hint: str | None = None,
                 config: Config | None = None) -> tuple[tuple[Plan, ...], Plan]:
    """Plans for the fill bands below `plan`'s context, smallest first (config fill_bands),
    and the whole context's plan to load with them: the runner starts in the first and moves
    up as a sequence grows (engine/runner/engine.py). Without bands, `plan` itself.

    `auto` keeps the first band only where the tuner made the plan for a GPU, the band's
    placement differs from `plan`'s (else it would only hold less KV) and it is predicted to
    decode faster after a short prompt (else the short moments would pay for it: band_pays);
    a band above it where it does so against the whole context's band. Never with drafting by
    a draft model or MTP, or RPC workers: their state is bound to the loaded model. `hint`:
    the route's, as for the plan (profiles.traffic). `config`: the daemon's live
    settings (None: config.toml)."""
    sizes = parse_bands(setting)
    if sizes == "off" or plan.draft_mode.loaded or plan.rpc_workers:
        return (), plan
    auto = sizes == "auto"
    if auto and (not card.has_gpu or plan.source != "tuner"):
        return (), plan
    base = config_request(model_name, shape.file_size, hint, config)
    request = request_from_load(plan.n_ctx, load, base.margin_bytes, base)
    if not card.has_gpu:  # all in RAM: the bands differ in their context alone
        return tuple(replace(plan, n_ctx=band, n_batch=min(plan.n_batch, band),
                             n_ubatch=min(plan.n_ubatch, band),
                             predicted_decode_by_depth=curve_up_to(
                                 plan.predicted_decode_by_depth, band),
                             predicted_ttft=tuple((n, t) for n, t in plan.predicted_ttft
                                                  if n < band),
                             reasons=(*plan.reasons, f"fill band: up to {band} tokens"))
                     for band in sizes if band < plan.n_ctx), plan
    bands = band_plans(shape, card, request, whole_plan=plan,
                       sizes=FILL_BANDS if auto else sizes,
                       tuned=lambda s, c, r: tune_checked(s, c, r))
    plans = [apply_options(p, request) for _, p in bands[:-1]]
    whole = apply_options(bands[-1][1], request)
    if auto:
        if not plans or not band_pays(plans[0], plan):
            return (), plan
        plans = plans[:1] + [p for p in plans[1:] if band_pays(p, whole)]
    return tuple(plans), whole


def curve_up_to(curve: tuple[tuple[int, float], ...],
                end: int) -> tuple[tuple[int, float], ...]:
    """A decode-by-depth curve cut at `end`, its last point there (per-token time is linear
    between the curve's points, so the speed there is interpolated through it)."""
    inside = [(d, v) for d, v in curve if d < end]
    after = next(((d, v) for d, v in curve if d >= end), None)
    if not inside or after is None or after[1] <= 0 or inside[-1][1] <= 0:
        return tuple(inside)
    (d0, v0), (d1, v1) = inside[-1], after
    t = 1 / v0 + (1 / v1 - 1 / v0) * (end - d0) / max(1, d1 - d0)
    return (*inside, (end, round(1 / t, 2)))


def band_pays(band: Plan, whole: Plan) -> bool:
    """Whether `auto` keeps a band: its placement differs from the whole plan's (else it would
    only hold less KV) and it decodes faster after a short prompt, the moment a band exists to
    serve (its switch costs a reload), or it is measuring a way (below)."""
    def at_start(plan: Plan) -> float:
        curve = plan.predicted_decode_by_depth
        return curve[0][1] if curve else plan.predicted_decode_tps
    return placement_key(band) != placement_key(whole) and (
        at_start(band) > at_start(whole) or measuring_ways(band))


def measuring_ways(plan: Plan) -> bool:
    """Whether the plan runs a way `auto` is still measuring (some of its ways unmeasured): a
    band that does is kept, so the way is measured where short prompts will be served. Dropped
    for being priced slower, its load ran the whole plan's own first way instead: on an H100
    lease the 8K band's settling spent two loads measuring the whole context's way."""
    return any(measured == 0 for _, _, measured in plan.ways)


def placement_key(plan: Plan) -> tuple:
    """Where the weights are and how batches run: what a band changes besides its context. The
    expert pool is part of it: on an H100 lease the 8K band's measured fastest way (a pool,
    its misses on the CPU) kept the same blocks in RAM as the whole plan without one, so the
    band was dropped as the same placement and short answers ran at 82 tok/s, not 115."""
    return (plan.n_gpu_layers, plan.tensor_overrides, plan.tensor_split, plan.n_batch,
            plan.n_ubatch, plan.flash_attn, plan.expert_cache, plan.expert_misses_on_gpu,
            plan.expert_cache_device)


def bands_setting(config: Config | None = None) -> str:
    """The config's fill_bands (auto, off, or token counts)."""
    config, _ = tuning_config(config)
    return config.fill_bands if config is not None else "auto"
