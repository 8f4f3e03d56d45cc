"""Plans per fill band: a model loads with the plan of a smaller context first and moves up.

Less KV on the GPU leaves room for more of the weights, so while a context is short a smaller
band's plan decodes faster; when a sequence is about to outgrow its band, the runner reloads
with the next band's plan and carries every sequence's KV over (daemon/runner/bands.py).

    band_plans(shape, card, request)            the tuner's plan per band, then the whole one
    choose_bands(shape, name, load, card, plan) the bands the daemon loads (config fill_bands)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from localllm.config import ConfigError, load_config, parse_bands
from localllm.modelstore.shape import ModelShape
from localllm.options import LoadOptions

from .card import Card
from .choose import apply_options, config_request, request_from_load, tune_checked
from .plan import Plan
from .quality import kv_label
from .tuner import NoPlanFits, Request, tune


FILL_BANDS = (8192, 32768)  # plans per fill band: up to each of these, then the whole context


def band_plans(shape: ModelShape, card: Card, request: Request, n_ctx: int | None = None,
               whole_plan: Plan | None = None, sizes: tuple[int, ...] = FILL_BANDS,
               tuned: Callable[[ModelShape, Card, Request], Plan] | None = None,
               ) -> list[tuple[int, Plan]]:
    """A plan per fill band: the best plan for a context of each band's size (less KV: more on
    the GPU), for the part of the session the band serves (Workload.in_band), then the whole
    context's (`whole_plan`, or tuned here). A runner loads the band its sequences need and
    moves up as they grow, carrying their KV over: so every band has the whole plan's slots,
    KV types and drafting (llama.cpp restores a sequence's state only into a context with the
    same ones). `tuned` plans one band (default `tune`; the daemon's checks compute buffers
    with dry runs)."""
    tuned = tuned or (lambda shape, card, request: tune(shape, card, request))
    whole = whole_plan or tuned(shape, card, replace(request, n_ctx=n_ctx or request.n_ctx))
    pinned = replace(request, num_parallel=whole.n_parallel,
                     kv_types=(kv_label(whole.type_k, whole.type_v),))
    out = []
    for band in (b for b in sizes if b < whole.n_ctx):
        try:
            plan = tuned(shape, card, replace(pinned, n_ctx=band,
                                              workload=request.workload.in_band(band)))
        except NoPlanFits:
            continue
        if plan.n_parallel != whole.n_parallel:
            continue
        out.append((band, replace(plan, speculative=whole.speculative,
                                  draft_n_max=whole.draft_n_max, reasons=(
                                      *plan.reasons, f"fill band: up to {band} tokens; a "
                                      f"sequence that needs more moves the runner to the next "
                                      f"band's plan"))))
    out.append((whole.n_ctx, whole))
    return out


def choose_bands(shape: ModelShape, model_name: str, load: LoadOptions, card: Card,
                 plan: Plan, setting: str = "auto") -> tuple[Plan, ...]:
    """Plans for the fill bands below `plan`'s context, smallest first (config fill_bands):
    the runner starts in the first and moves up as a sequence grows (daemon/runner/engine.py).

    `auto` keeps a band only where the tuner made the plan for a GPU, the band's placement
    differs from the whole context's (else it would only hold less KV) and it is predicted to
    decode faster after a short prompt (else the short moments would pay for it: band_pays).
    Never with drafting by a draft model or MTP, or RPC workers: their state is bound to the
    loaded model."""
    sizes = parse_bands(setting)
    if sizes == "off" or plan.speculative in ("mtp", "draft") or plan.rpc_workers:
        return ()
    auto = sizes == "auto"
    if auto and (not card.has_gpu or plan.source != "tuner"):
        return ()
    base = config_request(model_name, shape.file_size)
    request = request_from_load(plan.n_ctx, load, base.margin_bytes, base)
    if not card.has_gpu:  # all in RAM: the bands differ in their context alone
        return tuple(replace(plan, n_ctx=band, n_batch=min(plan.n_batch, band),
                             n_ubatch=min(plan.n_ubatch, band),
                             predicted_decode_by_depth=curve_up_to(
                                 plan.predicted_decode_by_depth, band),
                             predicted_ttft=tuple((n, t) for n, t in plan.predicted_ttft
                                                  if n < band),
                             reasons=(*plan.reasons, f"fill band: up to {band} tokens"))
                     for band in sizes if band < plan.n_ctx)
    bands = band_plans(shape, card, request, whole_plan=plan,
                       sizes=FILL_BANDS if auto else sizes,
                       tuned=lambda s, c, r: tune_checked(s, c, r))
    plans = [apply_options(p, request) for _, p in bands[:-1]]
    if auto:
        plans = [p for p in plans if band_pays(p, plan)]
    return tuple(plans)


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
    serve (its switch costs a reload)."""
    def at_start(plan: Plan) -> float:
        curve = plan.predicted_decode_by_depth
        return curve[0][1] if curve else plan.predicted_decode_tps
    return placement_key(band) != placement_key(whole) and at_start(band) > at_start(whole)


def placement_key(plan: Plan) -> tuple:
    """Where the weights are and how batches run: what a band changes besides its context."""
    return (plan.n_gpu_layers, plan.tensor_overrides, plan.tensor_split, plan.n_batch,
            plan.n_ubatch, plan.flash_attn)


def bands_setting() -> str:
    """The config's fill_bands (auto, off, or token counts)."""
    try:
        return load_config().fill_bands
    except ConfigError:
        return "auto"
