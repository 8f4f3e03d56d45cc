"""`localllm tune MODEL`: print (and save) the plan for a model on this card or a named one.

    localllm tune 27b-q3                         the plan for this machine, saved as a profile
    localllm tune model.gguf --card rtx3060-12g  plan for a box from planner/cards/
    localllm tune gemma3-27b --card rtx3060-12g --ram 16   a catalog model before pulling it
    localllm tune 27b-q3 --ctx 32768 --vram 10   a context, and a smaller memory budget
    localllm tune 27b-q3 --measure               load it, time it, calibrate the speed model
    localllm tune --reset-calibration            forget what --measure calibrated
    localllm tune 27b-q3 --json                  the plan as JSON
    localllm tune 27b-q3 --calibrate             measure the card's bandwidths first (torch)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from localllm.config import parse_bands
from localllm.errors import UserError
from localllm.kv_types import KV_SETTINGS
from localllm.modelstore.shape import ModelShape, read_shape

from localllm.planner.card import MIB, Card, card_names
from localllm.planner import quality
from localllm.options import LoadOptions
from localllm.profiles.bands import FILL_BANDS, band_plans, bands_setting, choose_bands
from localllm.profiles.choose import config_request, gpus_setting, tune_checked
from localllm.planner.explain import REJECTED
from localllm.planner.words import gib
from localllm.engine.hardware import resolve_card
from localllm.profiles.calibration import calibrated
from localllm.profiles.host_prices import measured_on_first_use, prices_of
from localllm.profiles.measure import (
    doubtful, measure_in_child, reset_calibration, update_calibration,
)
from localllm.planner.costs import model_costs
from localllm.planner.plan import Plan, layer_ranges
from localllm.planner.quality import split_kv
from localllm.profiles.saved import save_profile
from localllm.planner.speed import predict_speed
from localllm.planner.search import Request
from localllm.planner.workload import WORKLOADS, from_fill


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune", help="plan how to run a model on this card (or a named one)",
        description="Choose GPU layers, tensor placement, context, KV type, batch and threads "
        "for MODEL (a stored model's name or a .gguf file), explain every choice, and save the "
        "plan as an editable profile the daemon loads with.")
    p.add_argument("model", nargs="?", help="a stored model's name, a path to a .gguf file, "
                   "or a catalog name not pulled yet (planned from its header, read by range "
                   "requests, or offline from the shape the catalog carries: nothing is "
                   "downloaded or saved)")
    p.add_argument("--card", default="auto",
                   help=f"a card profile ({', '.join(card_names())}): the whole box it "
                   "describes (GPUs, RAM, cores, disk); several joined by + "
                   "(rtx3090+rtx3060-12g: one box with both), or auto (probe this machine)")
    p.add_argument("--ram", type=float, metavar="GiB", help="plan for a host with this much RAM")
    p.add_argument("--cores", type=int, help="plan for a host with this many CPU cores")
    p.add_argument("--ctx", type=int, help="the context length to plan for (default: the "
                   "largest up to the trained one that keeps decode fast, at least 4096)")
    p.add_argument("--vram", type=float, metavar="GiB",
                   help="plan for this much GPU memory instead of the card's")
    p.add_argument("--margin", type=int, metavar="MiB",
                   help="VRAM to leave free (default: vram_margin_mib from the config, 512)")
    p.add_argument("--threads", type=int, help="CPU threads (default: physical cores)")
    p.add_argument("--quality", choices=quality.POLICIES,
                   help="how much quality the KV cache may cost (default: the config's quality, "
                   "balanced)")
    p.add_argument("--kv", metavar="TYPE", help=f"pin the KV cache: {', '.join(KV_SETTINGS)} "
                   "(default: the config's kv_cache_type, auto)")
    p.add_argument("--workload", choices=tuple(WORKLOADS),
                   help="the session to plan for: chat (short prompts) or agent (a 20K-token "
                   "prompt growing by 2K a turn); the plan minimizes its total time (default: "
                   "as the daemon plans the model's next load: the mix it served, once it has "
                   "served 4 requests, else the config's workload)")
    p.add_argument("--fill", type=float, metavar="FRACTION",
                   help="the older form of --workload: one answer filling this part of the "
                   "context, decode averaged over it")
    p.add_argument("--parallel", metavar="N|auto",
                   help="slots (requests served together), a cap (default: the config's "
                   "num_parallel, auto: up to 4)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--measure", action="store_true",
                   help="load the plan for real, time prefill and decode, calibrate the model")
    p.add_argument("--calibrate", action="store_true",
                   help="measure the disk's read rate (reading the model's file) and this "
                   "card's memory and host-to-device bandwidth with torch (the [torch] extra), "
                   "and use them from now on")
    p.add_argument("--no-save", action="store_true",
                   help="write nothing: neither the profile nor --measure's calibration")
    p.add_argument("--save", action="store_true",
                   help="store --measure's figure even when it looks disturbed (far below the "
                   "prediction while other processes kept the CPU busy)")
    p.add_argument("--reset-calibration", action="store_true",
                   help="forget the speed factors --measure stored (--calibrate's bandwidths "
                   "stay) and exit")
    p.set_defaults(func=cmd_tune)


def resolve_model(model: str) -> tuple[ModelShape, str, str]:
    """(shape, profile name, how a remote header was read or "") for a store name, a .gguf
    path, or a catalog name not pulled yet (its header read by range requests, as `pull
    --quant auto` reads each candidate's). A store name comes back in the store's own
    spelling (`smollm2` -> `smollm2:latest`), the name the daemon loads it under, so the
    profile and eval results saved under it are the ones the daemon reads."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" or path.is_file():
        if not path.is_file():
            raise UserError(f"no such model file: {path}")
        return read_shape(path), path.stem, ""
    from localllm.modelstore import catalog
    from localllm.modelstore.store import default_store

    store = default_store()
    entry = catalog.lookup(model)
    if store.exists(model) or entry is None:
        found = store.get(model)
        return read_shape(found.model_path), str(found.name), ""
    return catalog_shape(entry)


def catalog_shape(entry) -> tuple[ModelShape, str, str]:
    """A catalog entry's shape without its file: the hub's header, or the catalog's own
    (localllm.cli.catalog_fit says which, and why)."""
    from localllm.cli.catalog_fit import entry_shape

    shape, where = entry_shape(entry)
    return shape, str(entry.name), where


def cmd_tune(args: argparse.Namespace) -> int:
    if args.reset_calibration:
        reset = reset_calibration()
        print(f"calibration reset for {', '.join(reset)}" if reset else
              "no --measure calibration was stored: nothing to reset")
        return 0
    if not args.model:
        raise UserError("tune needs a MODEL (a stored model's name or a .gguf file)")
    if args.save and args.no_save:
        raise UserError("--save and --no-save ask for opposite things: pass one")
    if args.vram is not None and args.vram <= 0:
        raise UserError("--vram must be a positive number of GiB")
    if args.ctx is not None and args.ctx < 256:
        raise UserError("--ctx must be at least 256")
    if args.margin is not None and args.margin < 0:
        raise UserError("--margin must be 0 or more MiB")
    if args.threads is not None and args.threads < 1:
        raise UserError("--threads must be at least 1")
    if args.ram is not None and args.ram <= 0 or args.cores is not None and args.cores < 1:
        raise UserError("--ram must be a positive number of GiB and --cores at least 1")
    shape, model_name, remote = resolve_model(args.model)
    if remote and (args.measure or args.calibrate):
        raise UserError(f"{args.model} is not pulled: --measure and --calibrate need its file "
                        f"(`localllm pull {args.model}` first)")
    card = measured_on_first_use(
        calibrated(resolve_card(args.card, gpus_setting(), args.ram, args.cores)))
    if args.calibrate:
        card = calibrate_machine(card, args.card, Path(shape.path))
    if args.vram is not None:
        card = card.with_vram(args.vram)
    request = request_from_args(args, config_request(model_name, shape.file_size))
    plan = tune_checked(shape, card, request)
    measured = None
    if args.measure:
        measured = measure_and_calibrate(shape, model_name, plan, card,
                                         store=not args.no_save, force=args.save)
    saved = None
    if not args.no_save and args.vram is None and not remote:
        saved = save_profile(plan, model_name, card.name, shape.file_size,
                             measured=asdict(measured) if measured else None)
    setting = parse_bands(bands_setting())
    bands = []
    if setting != "off":
        if card.has_gpu:
            bands = band_plans(shape, card, request, whole_plan=plan,
                               sizes=FILL_BANDS if setting == "auto" else setting)
        else:  # as the daemon loads them on a CPU: the same plan at each band's context
            below, whole = choose_bands(shape, model_name, LoadOptions(), card, plan,
                                        bands_setting())
            bands = [*((p.n_ctx, p) for p in below), (whole.n_ctx, whole)]
    if args.json:
        out = {"model": model_name, "card": asdict(card), "plan": plan.to_dict(),
               # the fill bands tried, and the whole context's plan beside them
               "bands": [{"up_to": n, "loaded": band_loaded(bands, i, plan, setting != "auto"),
                          "plan": p.to_dict()} for i, (n, p) in enumerate(bands)]
               if len(bands) > 1 else [],
               "measured": asdict(measured) if measured else None,
               # each price of the machine the plan was priced with, and its source
               "prices": prices_of(card),
               "profile": str(saved) if saved else None}
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(plan, card, shape, model_name))
        if len(bands) > 1:
            print("\n" + format_bands(bands, shape, explicit=setting != "auto", plan=plan))
        if measured:
            print(f"\nmeasured: prefill {measured.prefill_tps:.1f} tok/s, decode "
                  f"{measured.decode_tps:.1f} tok/s (predicted {plan.predicted_prefill_tps:.1f} "
                  f"/ {plan.predicted_decode_tps:.1f})"
                  + (f", VRAM {gib(measured.vram_bytes)} (predicted {gib(plan.vram_bytes())})"
                     if measured.vram_bytes else ""))
            if pool := measured.expert_cache:
                lookups = pool["hits"] + pool["misses"]
                print(f"expert cache: {pool['slots']} slots, "
                      f"{pool['hits'] / max(lookups, 1):.0%} hits of {lookups} lookups"
                      + ("" if args.no_save else " (kept for the tuner's next pricing)"))
        if saved:
            print(f"\nsaved profile: {saved}")
        if remote:
            print(f"\n{remote}; nothing downloaded, no profile saved (`localllm pull "
                  f"{args.model}`, then `tune` saves one)")
    return 0


def calibrate_machine(card: Card, card_name: str, model_path: Path) -> Card:
    """--calibrate: the disk read rate (reading the model's file), then, with a GPU, the card's
    bandwidths; each stored as it is measured."""
    from localllm.profiles.calibrate import calibrate, measure_disk_read, store_disk_read

    if card_name != "auto":
        raise UserError("--calibrate measures this machine's card: leave out --card")
    disk = measure_disk_read(model_path)
    store_disk_read(disk)
    card = replace(card, disk_read_gbs=round(disk.gbs, 2))
    print(f"calibrated the disk: {disk.gbs:.2f} GB/s reading {disk.bytes_read / (1 << 20):.0f} "
          f"MiB of {model_path.name} ({disk.how})", file=sys.stderr)
    if not card.has_gpu:
        print("no GPU here: only the disk was measured", file=sys.stderr)
        return card
    measured, card = calibrate(card)
    print(f"calibrated {card.name}: memory {measured.memory_gbs:.0f} GB/s, host to device "
          f"{measured.host_to_device_gbs:.1f} GB/s", file=sys.stderr)
    return card


def request_from_args(args: argparse.Namespace, base: Request) -> Request:
    """The config's tuner settings with the command line's on top."""
    changes: dict = {"n_ctx": args.ctx, "n_threads": args.threads}
    if args.margin is not None:
        changes["margin_bytes"] = args.margin * MIB
    if args.quality:
        changes["quality"] = args.quality
    if args.kv:
        try:
            split_kv(args.kv)
        except ValueError as e:
            raise UserError(f"--kv: {e}") from None
        changes["kv_types"] = (args.kv,)
    if args.fill is not None:
        if not 0.05 <= args.fill <= 1:
            raise UserError("--fill must be between 0.05 and 1 (the part of the context filled)")
        changes["workload"] = from_fill(args.fill)
    elif args.workload:
        changes["workload"] = WORKLOADS[args.workload]
    if "workload" in changes:
        changes["workload_source"] = "--fill" if args.fill is not None else "--workload"
    if args.parallel is not None:
        if args.parallel == "auto":
            changes["num_parallel"] = None
        elif args.parallel.isdigit() and 1 <= int(args.parallel) <= 64:
            changes["num_parallel"] = int(args.parallel)
        else:
            raise UserError("--parallel must be auto or a number from 1 to 64")
    return replace(base, **changes)


def measure_and_calibrate(shape: ModelShape, model_name: str, plan: Plan, card: Card,
                          store: bool = True, force: bool = False):
    """Time the plan for real; the figure becomes this card's calibration unless `store` is
    off, or it looks disturbed by other work (`force` stores it anyway). A plan with an expert
    pool decodes long enough to measure its hit rate, which is stored for the tuner."""
    from localllm.engine.expert_cache import ExpertCacheStats
    from localllm.profiles.expert_hits import record_pool, tokens_for_lookups

    print(f"measuring {shape.name} with the plan...", file=sys.stderr)
    tokens = 32  # measure_in_child's own default
    if plan.expert_cache:  # long enough for the pool's hit rate to be kept
        tokens = max(tokens, tokens_for_lookups(shape.n_layer_main, shape.expert_used_count))
    measured = measure_in_child(shape.path, plan, decode_tokens=tokens)
    if not store:
        return measured
    if measured.expert_cache:
        record_pool(model_name, shape.file_size, shape.expert_count,
                    ExpertCacheStats(**measured.expert_cache))
    why = doubtful(measured, plan.predicted_decode_tps)
    if why and not force:
        print(f"warning: {why}; the calibration was not stored (measure again on a quiet "
              "machine, or pass --save to store it)", file=sys.stderr)
        return measured
    from localllm.profiles.choose import placement_of, settings_of

    speed = predict_speed(model_costs(shape), placement_of(plan, shape), settings_of(plan), card,
                          plan.n_threads, depth=measured.prompt_tokens)
    update_calibration(card.name, speed.decode_seconds_gpu, speed.decode_seconds_cpu,
                       measured.decode_tps)
    return measured


def format_bands(bands: list[tuple[int, Plan]], shape: ModelShape,
                 explicit: bool = False, plan: Plan | None = None) -> str:
    """One line per fill band: the workload it is planned for, its placement, KV, micro-batch,
    decode at its start and end, the time to first token of its longest prompt shown, and
    whether the daemon loads it: every band fill_bands names (`explicit`), those that pay
    under `auto` (bands.band_pays: the first against `plan`, the whole context's plan without
    bands; the others against the whole context's band)."""
    from localllm.profiles.bands import placement_key
    from localllm.planner.placements import kind_of
    from localllm.profiles.choose import placement_of

    whole = bands[-1][1]
    plan = plan or whole
    lines = ["plans per fill band (each for the prompt that enters it):"]
    for i, (band, p) in enumerate(bands):
        against = plan if i == 0 else whole
        placement = placement_of(p, shape)
        kept = kind_of(placement).short(placement)  # what the placement keeps in RAM
        where = f"{kept}, n_gpu_layers={p.n_gpu_layers}" if kept \
            else f"n_gpu_layers={p.n_gpu_layers}"
        depths = dict(p.predicted_decode_by_depth)
        ttft = ""
        if p.predicted_ttft:
            n, t = p.predicted_ttft[-1]
            ttft = f", {n // 1024}K prompt in {_seconds(t)}"
        if p is whole:
            loaded = "the whole context" if band_loaded(bands, i, plan, explicit) else \
                "not loaded: without bands the plan above holds the whole context"
        elif band_loaded(bands, i, plan, explicit):
            loaded = "loaded while the sequences fit it"
        elif i and not band_loaded(bands, 0, plan, explicit):
            loaded = "not loaded: the first band is not"
        elif placement_key(p) == placement_key(against):
            loaded = "not loaded: the whole plan's placement"
        else:
            loaded = "not loaded: it decodes no faster after a short prompt than the whole plan"
        lines.append(f"  up to {band} ({p.workload.split(':')[0]}): {where}, {p.type_k} KV, "
                     f"ubatch {p.n_ubatch}; decode {depths.get(0, 0):.1f} tok/s at the start, "
                     f"{depths.get(band, 0):.1f} at {band}{ttft}; {loaded}")
    return "\n".join(lines)


def band_loaded(bands: list[tuple[int, Plan]], i: int, plan: Plan, explicit: bool) -> bool:
    """Whether the daemon loads band i of `bands` (the last: the whole context's band), as
    profiles.bands.choose_bands keeps them; without bands it loads `plan` alone."""
    from localllm.profiles.bands import band_pays

    if explicit:
        return True
    if len(bands) < 2 or not band_pays(bands[0][1], plan):
        return False
    last = len(bands) - 1
    return i in (0, last) or band_pays(bands[i][1], bands[last][1])


def _seconds(t: float) -> str:
    return f"{t:.1f} s" if t < 100 else f"{t:.0f} s"


def _row(cells: list[str], widths: list[int]) -> str:
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(
        zip(cells, widths, strict=True)))


def speculation_summary(plan: Plan) -> str:
    """The plan's speculative decoding in one line, with the decode it predicts with and
    without (the reasons say why)."""
    plain = plan.predicted_plain_decode_tps or plan.predicted_decode_tps
    if not plan.draft_mode.drafts:
        return f"speculation: off (predicted decode {plain:.1f} tok/s without it)"
    what = f"{plan.speculative}, drafts up to {plan.draft_ceiling()}"
    if plan.draft_mode.draft_model:
        what += f", {plan.draft_n_gpu_layers} draft layers on the GPU"
    return (f"speculation: {what}; predicted decode {plan.predicted_decode_tps:.1f} tok/s with "
            f"it, {plain:.1f} without")


def format_plan(plan: Plan, card: Card, shape: ModelShape, model_name: str) -> str:
    lines = [f"{model_name}: {shape.architecture}, {shape.size_label} {shape.file_type}, "
             f"{gib(shape.weight_bytes)}, {shape.n_layer} blocks, trained context "
             f"{shape.context_length}", box_line(card), ""]
    header = ["device", "weights", "KV", "compute", "overhead", "total", "has", "headroom"]
    rows = []
    for m in plan.memory:
        if m.device == "CPU":
            free = card.ram_bytes
        elif m.device in card.devices:
            free = card.gpu(m.device).free_vram_bytes
        else:
            free = card.free_vram_bytes
        rows.append([m.device, gib(m.weights), gib(m.kv), gib(m.compute),
                     gib(m.overhead) if m.device != "CPU" else "-", gib(m.total), gib(free),
                     gib(free - m.total)])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines += [_row(header, widths), *(_row(r, widths) for r in rows), ""]
    settings = (f"n_ctx={plan.n_ctx} n_gpu_layers={plan.n_gpu_layers} "
                f"type_k={plan.type_k} type_v={plan.type_v} flash_attn={plan.flash_attn} "
                f"n_batch={plan.n_batch} n_ubatch={plan.n_ubatch} threads={plan.n_threads} "
                f"n_parallel={plan.n_parallel} swa_full={plan.swa_full}")
    lines.append(settings)
    if plan.tensor_split:
        lines.append("split (tensor_split, by layer): "
                     + "; ".join(layer_ranges(plan.device_layers)))
    for o in plan.tensor_overrides:
        lines.append(f"override: {o.pattern} -> {o.device}")
    lines.append(f"predicted: prefill {plan.predicted_prefill_tps:.1f} tok/s, decode "
                 f"{plan.predicted_decode_tps:.1f} tok/s averaged over the session's answers")
    if plan.workload:
        lines.append("workload" + (f" ({plan.workload_source})" if plan.workload_source
                                   else "") + f": {plan.workload}")
        lines.append(f"session ({plan.workload}): {plan.predicted_session_s:.0f} s predicted")
    if plan.predicted_ttft:
        lines.append("predicted time to first token: " + ", ".join(
            f"{n // 1024}K-token prompt {_seconds(t)}" for n, t in plan.predicted_ttft))
    lines.append(speculation_summary(plan))
    if plan.predicted_decode_by_depth:
        names = ("start", "middle", "end")
        lines.append("predicted decode as the context fills: " + ", ".join(
            f"{name} ({depth} tokens) {tps:.1f} tok/s"
            for name, (depth, tps) in zip(names, plan.predicted_decode_by_depth, strict=False)))
    lines.append("")
    lines.append("why:")
    lines += [f"  - {r}" for r in plan.reasons if not r.startswith(REJECTED)]
    rejected = [r[len(REJECTED):] for r in plan.reasons if r.startswith(REJECTED)]
    if rejected:
        lines.append("rejected:")
        lines += [f"  - {r}" for r in rejected]
    return "\n".join(lines)


__all__ = ["cmd_tune", "format_plan", "register"]


def box_line(card: Card) -> str:
    """The machine planned for: its GPUs and its host, and where the figures come from."""
    gpus = ", ".join(f"{g.label} {gib(g.vram_bytes)}" for g in card.gpu_list) or "no GPU"
    disk = f", disk {card.disk_read_gbs:g} GB/s" if card.disk_read_gbs else ""
    where = {"probe": "this machine", "profile": f"card profile {card.name}",
             "profile+host": f"card profile {card.name}, host as --ram/--cores say"}
    return (f"on: {gpus}; host {gib(card.ram_bytes)} RAM, {card.cores} cores{disk} "
            f"({where.get(card.source, card.source)})")
