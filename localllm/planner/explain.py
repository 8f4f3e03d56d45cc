"""The tuner's decisions in words: why each choice, the nearest alternatives it turned down and
why, and what would fit when nothing does. Lines that start with "rejected: " are alternatives.
"""

from __future__ import annotations

from collections.abc import Callable

from localllm.modelstore.shape import ModelShape

from . import quality
from .card import Card
from .disk import disk_reason
from .evaluator import Evaluator
from .explain_speculation import speculation_lines
from .memory import CPU, ContextSettings, gpu_layers
from .placements import kind_of, span
from .plan import layer_ranges
from .search import Option, Request, Search
from .words import describe_placement, gib, seconds, tps

REJECTED = "rejected: "


def _kv_text(settings: ContextSettings) -> str:
    return f"{quality.kv_label(settings.type_k, settings.type_v)} KV"


def _threads_line(card: Card, threads: int, cpu_weights: int) -> str:
    if threads >= card.cores:
        return (f"{threads} threads = physical cores: {gib(cpu_weights)} of weights stay in RAM "
                "and decode on the CPU fastest with one thread per core")
    return (f"{threads} of {card.cores} threads at decode, as asked (num_thread): "
            f"{gib(cpu_weights)} of weights stay in RAM; prompts are read with all {card.cores}")


def explain(shape: ModelShape, card: Card, request: Request, chosen: Search,
            searches: list[Search], evaluator: Evaluator, threads: int, single: Option,
            slot_note: str, speculation_notes: list[str] | None = None) -> list[str]:
    """`chosen.best` is the final option (slots and SWA cache included); `single` the option
    the search picked, with one slot."""
    best = chosen.best
    assert best is not None
    s = best.settings
    out = [_budget_line(card, request, best)]
    out.append(_context_line(shape, request, chosen, searches))
    if not card.has_gpu:
        out.append(f"all {shape.n_layer_main} blocks on the CPU: no GPU; {threads} threads = "
                   "physical cores")
        if best.disk_bytes:
            out.append(disk_reason(best.disk_bytes, card))
        out.append(_kv_line(single, chosen, request, evaluator, card))
        out.append(_fill_line(best, request, evaluator))
        out += _slot_lines(best, request, card, slot_note)
        out += speculation_lines(shape, card, request, chosen, evaluator, speculation_notes or [])
        return out + _context_alternatives(chosen, searches)
    used, usable = best.vram_used, best.vram_budget
    if best.device_budgets:  # several GPUs: all of them together
        used = sum(m.total for m in best.memory if m.device != CPU)
        usable = sum(b for _, b in best.device_budgets)
    out.append(describe_placement(best, shape) + f": {gib(used)} of "
               f"{gib(usable)} usable VRAM; predicted "
               f"{tps(best.speed.decode_tps)} decode, {tps(best.speed.prefill_tps)} prefill")
    out += split_lines(shape, card, best, chosen)
    if best.disk_bytes:
        out.append(disk_reason(best.disk_bytes, card))
    out += kind_of(best.placement).reasons(best.placement)
    out.append(_fill_line(best, request, evaluator))
    out.append(_kv_line(single, chosen, request, evaluator, card))
    out.append("flash attention on: the quantized V cache needs it and it keeps the compute "
               "buffer small at long context" if s.type_v != "f16" else
               "flash attention on: it keeps the compute buffer small at long context")
    out += _ubatch_lines(best, chosen)
    if chosen.prompt_note:
        out.append(chosen.prompt_note)
    cpu_weights = next((m.weights for m in best.memory if m.device == CPU), 0)
    if cpu_weights > shape.embedding_bytes * 1.5:
        out.append(_threads_line(card, threads, cpu_weights))
    else:
        out.append(f"{threads} threads: the GPU does the work; the CPU only feeds it")
    out += _slot_lines(best, request, card, slot_note)
    out += speculation_lines(shape, card, request, chosen, evaluator, speculation_notes or [])
    out += _rejected_alternatives(shape, single, chosen, evaluator)
    out += _context_alternatives(chosen, searches)
    return out


def _fill_line(best: Option, request: Request, evaluator: Evaluator) -> str:
    n = best.settings.n_ctx
    at = [evaluator.option_speed(best, d).decode_tps for d in (0, n // 2, n)]
    line = (f"decode {tps(best.speed.decode_tps)} averaged over the session's answers: "
            f"{tps(at[0])} at the start, {tps(at[1])} at {n // 2} tokens, {tps(at[2])} at {n}")
    session = best.session
    if session is None or not session.turns:
        return line
    turns = session.turns
    first = turns[0]
    line += (f"; the session ({request.workload.describe()}) takes {seconds(session.total)}: "
             f"{seconds(session.prompt_total)} reading prompts")
    if first.prompt:
        line += f" (the first, {first.prompt} tokens, {seconds(session.prompt_seconds[0])})"
    deepest = turns[-1].end
    return line + (f", {seconds(session.decode_total)} decoding answers at 0-{deepest} tokens "
                   "of context")


def moments(best: Option, other: Option) -> str:
    """Where in the session `best` gains over `other` and where it loses: the first prompt,
    later prompts, answers early or late (by depth)."""
    a, b = best.session, other.session
    if a is None or b is None or len(a.turns) != len(b.turns) or not a.turns:
        return ""
    parts = {"the first prompt": b.prompt_seconds[0] - a.prompt_seconds[0],
             "later prompts": sum(b.prompt_seconds[1:]) - sum(a.prompt_seconds[1:])}
    half = max(1, len(a.turns) // 2)
    early, late = a.turns[:half], a.turns[half:]
    parts[f"answers up to {early[-1].end} tokens"] = \
        sum(b.decode_seconds[:half]) - sum(a.decode_seconds[:half])
    if late:
        parts[f"answers at {late[0].start}-{late[-1].end} tokens"] = \
            sum(b.decode_seconds[half:]) - sum(a.decode_seconds[half:])
    gains = [f"{name} ({seconds(d)} faster)" for name, d in parts.items() if d > 0.05]
    losses = [f"{name} ({seconds(-d)} slower)" for name, d in parts.items() if d < -0.05]
    text = "serves " + (", ".join(gains) if gains else "nothing the other does not")
    return text + (f"; costs {', '.join(losses)}" if losses else "")


def _slot_lines(best: Option, request: Request, card: Card, slot_note: str) -> list[str]:
    s = best.settings
    cap = "auto" if request.num_parallel is None else str(request.num_parallel)
    out = []
    if s.n_seq > 1:
        where = "beside the placement, without moving weights off the GPU" if card.has_gpu \
            else "in the RAM budget"
        out.append(f"{s.n_seq} slots (num_parallel {cap}): requests decode together, each slot "
                   f"with its own {s.n_ctx} tokens of KV; they fit {where}")
    else:
        out.append(f"1 slot (num_parallel {cap})" + (f": {slot_note}" if slot_note else ""))
    if s.swa_full:
        out.append("full-size sliding-window cache (swa_full): the VRAM left holds it, so a "
                   "conversation's earlier turns stay reusable past the window instead of being "
                   "processed again")
    return out


def _kv_line(best: Option, chosen: Search, request: Request, evaluator: Evaluator,
             card: Card) -> str:
    label = best.kv
    cost = evaluator.kv_costs.get(label) or quality.KvCost(
        label, quality.ASSUMED_KL.get(label, 0.0), False)
    text = f"{label} KV cache: {cost.describe()}"
    if request.kv_types:
        return text + "; pinned by kv_cache_type"
    allowed = quality.allowed(request.quality, evaluator.kv_costs)
    text += f"; quality {request.quality} allows {', '.join(allowed)}"
    if chosen.quality_note:
        text += f"; {chosen.quality_note}"
    more_precise = [o for o in chosen.options if o.fits and quality.kv_rank(o.kv)
                    < quality.kv_rank(label) and o.settings.n_ctx == best.settings.n_ctx]
    if more_precise:
        alt = max(more_precise, key=lambda o: o.speed.decode_tps)
        text += (f"; {alt.kv} would decode at {tps(alt.speed.decode_tps)} "
                 f"vs {tps(best.speed.decode_tps)}")
    elif label != quality.REFERENCE:
        text += "; the more precise settings do not fit"
    if card.has_gpu and label == "q4_0":
        text += ("; q8_0 K with q4_0 V is not tried: this CUDA build has flash-attention "
                 "kernels only for matching K and V types, and the pair would attend on the CPU")
    return text


def _ubatch_lines(best: Option, chosen: Search) -> list[str]:
    """Why this micro-batch: against the best option of the same KV and kind of placement at
    each other micro-batch, which moments of the session it serves."""
    s = best.settings

    def same_kind(o: Option) -> bool:
        return (o.kv == best.kv and o.fits and o.speculator == best.speculator
                and kind_of(o.placement) is kind_of(best.placement))

    others: dict[int, Option] = {}
    for o in chosen.options:
        ub = o.settings.n_ubatch
        if ub != s.n_ubatch and same_kind(o) and o.settings.n_seq == 1 and \
                (ub not in others or o.session_seconds < others[ub].session_seconds):
            others[ub] = o
    if not others:
        return [f"ubatch {s.n_ubatch}"]
    text = [f"ubatch {s.n_ubatch} (n_batch {max(2048, s.n_ubatch)}): the prompt is read "
            f"{s.n_ubatch} tokens per pass, weights in RAM crossing to the GPU once per pass"]
    for ub, o in sorted(others.items()):
        text.append(f"over ubatch {ub} ({describe_layers(o)}, session "
                    f"{seconds(o.session_seconds)}) it {moments(best, o)}")
    return ["; ".join(text)]


def describe_layers(o: Option) -> str:
    p = o.placement
    return kind_of(p).short(p) or f"n_gpu_layers={p.n_gpu_layers}"


def split_lines(shape: ModelShape, card: Card, best: Option, chosen: Search) -> list[str]:
    """Several GPUs: the layers and memory of each, and why a GPU was left out."""
    if card.n_gpus < 2:
        return []
    layers = gpu_layers(shape, card, best.placement)
    budgets = dict(best.device_budgets)
    used = {m.device: m.total for m in best.memory}
    per_gpu = [f"{r}, {gib(used[d])} of {gib(budgets.get(d, best.vram_budget))}"
               for (d, k), r in zip([x for x in layers[1:] if x[1]],
                                    layer_ranges(layers[1:]), strict=True)]
    first = layers[0][1]
    out = [f"split over the GPUs by layer (tensor_split {[k for _, k in layers[1:]]}): "
           + "; ".join(per_gpu) + (f" ({span(0, first - 1)} in RAM)" if first else "")
           + "; each GPU holds its layers' KV, the output layer is the last"]
    left_out = [d for d, k in layers[1:] if not k]
    if left_out and best.placement.n_gpu_layers:
        everyone = [o for o in chosen.options if o.fits and o.pays and all(
            k for _, k in gpu_layers(shape, card, o.placement)[1:])]
        names = ", ".join(f"{d} ({card.gpu(d).label}, {card.gpu(d).bandwidth_gbs:g} GB/s)"
                          for d in left_out)
        if everyone:
            alt = min(everyone, key=lambda o: o.session_seconds)
            out.append(f"{names} left out: the best plan using every GPU takes "
                       f"{seconds(alt.session_seconds)} for the session "
                       f"({tps(alt.speed.decode_tps)} decode) against "
                       f"{seconds(best.session_seconds)} ({tps(best.speed.decode_tps)}) without "
                       f"it; it keeps only its CUDA context ({gib(card.overhead_bytes)})")
        else:
            out.append(f"{names} left out: no plan that gives it layers fits")
    return out


def _budget_line(card: Card, request: Request, best: Option) -> str:
    host = f"host {gib(card.ram_bytes)} RAM, {card.cores} cores"
    if not card.has_gpu:
        return f"no GPU ({card.label}); {host}"
    if card.n_gpus > 1:
        gpus = "; ".join(f"{g.device} {g.label} {gib(g.free_vram_bytes)} free, "
                         f"{g.bandwidth_gbs:g} GB/s" for g in card.gpu_list)
        pool = (f" (the first also less {gib(request.reserved_vram_bytes)} for the expert "
                "cache's pool)" if request.reserved_vram_bytes else "")
        return (f"{card.n_gpus} GPUs ({gpus}): each less a {gib(request.margin_bytes)} margin "
                f"is usable{pool}, of which {gib(card.overhead_bytes)} go to its CUDA context; "
                f"{host}")
    gpus = f"{card.n_gpus} x " if card.n_gpus > 1 else ""
    pool = (f" and {gib(request.reserved_vram_bytes)} for the expert cache's pool"
            if request.reserved_vram_bytes else "")
    return (f"{gpus}{card.label}: {gib(card.free_vram_bytes)} free less a "
            f"{gib(request.margin_bytes)} margin{pool} leaves {gib(best.vram_budget)} usable, "
            "of which "
            f"{gib(card.overhead_bytes)} go to the CUDA context; {host}")


def _context_line(shape: ModelShape, request: Request, chosen: Search,
                  searches: list[Search]) -> str:
    trained = shape.context_length
    if request.n_ctx:
        if trained and request.n_ctx > trained:
            return f"context {chosen.n_ctx}: capped at the trained context (asked {request.n_ctx})"
        return f"context {chosen.n_ctx}, as asked"
    if len(searches) == 1:
        return f"context {chosen.n_ctx}: the default without a GPU (trained {trained})"
    if chosen.n_ctx == searches[-1].n_ctx:
        return f"context {chosen.n_ctx}: the trained context fits without slowing decode"
    return (f"context {chosen.n_ctx}: the largest up to the trained {trained} that keeps decode "
            f"within 10% of its speed at {searches[0].n_ctx}")


def _rejected_alternatives(shape: ModelShape, best: Option, chosen: Search,
                           evaluator: Evaluator) -> list[str]:
    evaluate = evaluator.option
    out = []
    p, s = best.placement, best.settings
    n_all = shape.n_layer + 1
    closer = kind_of(p).closer(p, n_all)
    if closer is not None:
        nearer, words = closer
        o = evaluate(nearer, s, best.speculator)
        if not o.gpu_fits:
            out.append(f"{REJECTED}{words} needs {gib(o.vram_used)} > {gib(o.vram_budget)} "
                       "usable VRAM")

    def kind(o: Option):
        return kind_of(o.placement)

    # The fastest of each kind of placement first (so the one the winner beat is always
    # shown), then the other KV settings.
    ranked = sorted(chosen.options, key=lambda o: o.session_seconds)
    first_of_kind = {}
    for o in ranked:
        first_of_kind.setdefault(kind(o), o)
    ordered = [o for o in ranked if first_of_kind[kind(o)] is o] + \
        [o for o in ranked if first_of_kind[kind(o)] is not o]
    request = evaluator.request
    allowed = () if request.kv_types else quality.allowed(request.quality, evaluator.kv_costs)
    seen = set()
    for o in ordered:
        key = (o.kv, kind(o))
        if o is best or key in seen or o.settings.n_ubatch != s.n_ubatch:
            continue
        seen.add(key)
        what = _kv_text(o.settings) + kind(o).alternative(o.placement)
        if not o.fits:
            limit = (f"{gib(o.vram_used)} VRAM > {gib(o.vram_budget)}" if not o.gpu_fits
                     else f"{gib(o.ram_used)} RAM > {gib(o.ram_budget)}")
            out.append(f"{REJECTED}{what}: does not fit ({limit})")
        else:
            n = o.settings.n_ctx
            start = evaluator.option_speed(o, 0).decode_tps
            out.append(f"{REJECTED}{what}: {describe_placement(o, shape)}, "
                       f"{tps(o.speed.decode_tps)} averaged over the session ({tps(start)} at "
                       f"the start, {tps(evaluator.option_speed(o, n).decode_tps)} "
                       f"at {n}), session {seconds(o.session_seconds)}; "
                       + (f"quality {request.quality} does not allow {o.kv} KV"
                          if allowed and o.kv not in allowed and best.kv in allowed
                          else "the plan " + moments(best, o)))
        if len(seen) >= 4:
            break
    return out


def _context_alternatives(chosen: Search, searches: list[Search]) -> list[str]:
    larger = [x for x in searches if x.n_ctx > chosen.n_ctx]
    if not larger or chosen.best is None:
        return []
    nxt = larger[0]
    if nxt.best is None:
        return [f"{REJECTED}{nxt.n_ctx} context: no plan fits"]
    base = chosen.best.speed.decode_tps
    drop = 100 * (1 - nxt.best.speed.decode_tps / base)
    return [f"{REJECTED}{nxt.n_ctx} context: {tps(nxt.best.speed.decode_tps)} "
            f"({drop:.0f}% slower, {nxt.best.settings.type_k} KV, "
            f"n_gpu_layers={nxt.best.placement.n_gpu_layers})"]


def impossible_message(shape: ModelShape, card: Card, request: Request,
                       searches: list[Search], search_at: Callable[[int], Search]) -> str:
    """Nothing fits: say what it would need, what there is, and the largest context that fits."""
    asked = searches[-1]
    model = f"{shape.name} ({shape.size_label} {shape.file_type}, {gib(shape.weight_bytes)})"
    where = (f"{card.label} ({gib(card.free_vram_bytes)} VRAM) with {gib(card.ram_bytes)} RAM"
             if card.has_gpu else f"this machine's {gib(card.ram_bytes)} RAM (no GPU)")
    # The least memory any option needed in total, to say how far off it is.
    leanest = min(asked.options, key=lambda o: o.ram_used + o.vram_used, default=None)
    need = ""
    if leanest is not None:
        kv = sum(m.kv for m in leanest.memory)
        weights = sum(m.weights for m in leanest.memory)
        if request.ram_budget_bytes:
            ram_why = " (the ram_budget setting)"
        elif card.ram_available_bytes:  # MemAvailable, or a memory cgroup's room, at load
            ram_why = (f" of {gib(card.ram_available_bytes)} available to this process (the "
                       "rest kept for the runner itself)")
        else:
            ram_why = ""
        usable = (f"{gib(leanest.vram_budget)} VRAM + {gib(leanest.ram_budget)} RAM{ram_why} are"
                  if card.has_gpu else f"{gib(leanest.ram_budget)} RAM{ram_why} is")
        need = (f": even with {leanest.settings.type_k} KV it needs "
                f"{gib(leanest.ram_used + leanest.vram_used)} (weights {gib(weights)}, KV "
                f"{gib(kv)}) but {usable} usable, and only weights can stay on disk")
    fits = ""
    smaller = [c for c in (131072, 65536, 32768, 16384, 8192, 4096, 2048)
               if c < asked.n_ctx]
    for c in smaller:
        found = search_at(c)
        if found.best is not None:
            b = found.best
            fits = (f"; context {c} would fit ({b.settings.type_k} KV, "
                    f"n_gpu_layers={b.placement.n_gpu_layers}, {tps(b.speed.decode_tps)})")
            break
    else:
        fits = "; no context fits: the model is larger than this machine's memory"
    return f"no plan fits {asked.n_ctx} context for {model} on {where}{need}{fits}"
