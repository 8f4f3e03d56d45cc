"""The tuner's decisions in words: why each choice, the nearest alternatives it turned down and
why, and what would fit when nothing does. Lines that start with "rejected: " are alternatives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from localllm.modelstore.shape import ModelShape

from .card import GIB, Card
from .memory import CPU, GPU_KV_TYPES, ContextSettings, Placement

if TYPE_CHECKING:
    from .tuner import Option, Request, Search

REJECTED = "rejected: "


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def tps(x: float) -> str:
    return f"{x:.1f} tok/s" if x < 100 else f"{x:.0f} tok/s"


def describe_placement(option: Option, shape: ModelShape) -> str:
    p = option.placement
    n_blocks = shape.n_layer_main
    n_gpu_blocks = sum(1 for m in _gpu_block_indices(option, shape))
    if not option.vram_used and p.n_gpu_layers == 0:
        return f"all {n_blocks} blocks on the CPU"
    head = "the lm-head on the CPU" if p.output_on_cpu or p.n_gpu_layers == 0 else \
        "the lm-head on the GPU"
    text = (f"all {n_blocks} blocks" if n_gpu_blocks >= n_blocks
            else f"{n_gpu_blocks} of {n_blocks} blocks") + f" on the GPU, {head}"
    if p.n_cpu_expert_layers:
        k = min(p.n_cpu_expert_layers, n_blocks)
        text += f"; the experts of blocks 0-{k - 1} in RAM"
    return text + f" (n_gpu_layers={p.n_gpu_layers})"


def _gpu_block_indices(option: Option, shape: ModelShape):
    n_all = shape.n_layer + 1
    start = n_all - min(option.placement.n_gpu_layers, n_all)
    return [i for i in range(shape.n_layer_main) if i >= start]


def _kv_text(settings: ContextSettings) -> str:
    return f"{settings.type_k} KV"


def explain(shape: ModelShape, card: Card, request: Request, chosen: Search,
            searches: list[Search], evaluate: Callable[[Placement, ContextSettings], Option],
            threads: int) -> list[str]:
    best = chosen.best
    assert best is not None
    s = best.settings
    out = [_budget_line(card, request, best)]
    out.append(_context_line(shape, request, chosen, searches))
    if not card.has_gpu:
        out.append(f"all {shape.n_layer_main} blocks on the CPU: no GPU; f16 KV, "
                   f"{threads} threads = physical cores")
        return out + _context_alternatives(chosen, searches)
    out.append(describe_placement(best, shape) + f": {gib(best.vram_used)} of "
               f"{gib(best.vram_budget)} usable VRAM; predicted "
               f"{tps(best.speed.decode_tps)} decode, {tps(best.speed.prefill_tps)} prefill")
    out.append(_kv_line(best, chosen))
    out.append("flash attention on: the quantized V cache needs it and it keeps the compute "
               "buffer small at long context" if s.type_v != "f16" else
               "flash attention on: it keeps the compute buffer small at long context")
    if s.n_ubatch < max(request.ubatch_sizes):
        out.append(f"ubatch {s.n_ubatch}: a smaller compute buffer buys room on the GPU "
                   "(prompt processing is a little slower)")
    cpu_weights = next((m.weights for m in best.memory if m.device == CPU), 0)
    if cpu_weights > shape.embedding_bytes * 1.5:
        out.append(f"{threads} threads = physical cores: {gib(cpu_weights)} of weights stay in "
                   "RAM and decode on the CPU fastest with one thread per core")
    else:
        out.append(f"{threads} threads: the GPU does the work; the CPU only feeds it")
    out += _rejected_alternatives(shape, best, chosen, evaluate)
    out += _context_alternatives(chosen, searches)
    return out


def _budget_line(card: Card, request: Request, best: Option) -> str:
    host = f"host {gib(card.ram_bytes)} RAM, {card.cores} cores"
    if not card.has_gpu:
        return f"no GPU ({card.label}); {host}"
    gpus = f"{card.n_gpus} x " if card.n_gpus > 1 else ""
    return (f"{gpus}{card.label}: {gib(card.free_vram_bytes)} free less a "
            f"{gib(request.margin_bytes)} margin leaves {gib(best.vram_budget)} usable, of which "
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


def _kv_line(best: Option, chosen: Search) -> str:
    s = best.settings
    others = [o for o in chosen.options if o.fits and o.settings.type_k != s.type_k]
    if s.type_k == "f16":
        return "f16 KV cache: the most precise; quantizing it would not make decode faster"
    better = [o for o in others if GPU_KV_TYPES.index(o.settings.type_k)
              < GPU_KV_TYPES.index(s.type_k)]
    if not better:
        return (f"{s.type_k} KV cache (K = V): the more precise types do not fit at this "
                "context")
    alt = max(better, key=lambda o: o.speed.decode_tps)
    return (f"{s.type_k} KV cache (K = V): it leaves room for more of the model on the GPU; "
            f"{alt.settings.type_k} would decode at {tps(alt.speed.decode_tps)} "
            f"vs {tps(best.speed.decode_tps)}")


def _rejected_alternatives(shape: ModelShape, best: Option, chosen: Search,
                           evaluate: Callable[[Placement, ContextSettings], Option]) -> list[str]:
    out = []
    p, s = best.placement, best.settings
    n_all = shape.n_layer + 1
    if p.n_gpu_layers < n_all and not p.n_cpu_expert_layers:
        more = evaluate(Placement(p.n_gpu_layers + 1, p.output_on_cpu), s)
        if not more.gpu_fits:
            out.append(f"{REJECTED}n_gpu_layers={p.n_gpu_layers + 1} needs "
                       f"{gib(more.vram_used)} > {gib(more.vram_budget)} usable VRAM")
    if p.n_cpu_expert_layers:
        fewer = evaluate(Placement(p.n_gpu_layers, p.output_on_cpu, p.n_cpu_expert_layers - 1), s)
        if not fewer.gpu_fits:
            out.append(f"{REJECTED}experts of {p.n_cpu_expert_layers - 1} blocks in RAM needs "
                       f"{gib(fewer.vram_used)} > {gib(fewer.vram_budget)} usable VRAM")
    seen = set()
    for o in sorted(chosen.options, key=lambda o: -o.speed.decode_tps):
        key = (o.settings.type_k, o.placement.output_on_cpu, bool(o.placement.n_cpu_expert_layers))
        if o is best or key in seen or o.settings.n_ubatch != s.n_ubatch:
            continue
        seen.add(key)
        what = _kv_text(o.settings)
        if o.placement.output_on_cpu:
            what += ", lm-head on the CPU"
        elif o.placement.n_cpu_expert_layers:
            what += f", experts of {o.placement.n_cpu_expert_layers} blocks in RAM"
        if not o.fits:
            limit = (f"{gib(o.vram_used)} VRAM > {gib(o.vram_budget)}" if not o.gpu_fits
                     else f"{gib(o.ram_used)} RAM > {gib(o.ram_budget)}")
            out.append(f"{REJECTED}{what}: does not fit ({limit})")
        else:
            out.append(f"{REJECTED}{what}: {describe_placement(o, shape)}, "
                       f"{tps(o.speed.decode_tps)}")
        if len(seen) >= 3:
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
        usable = (f"{gib(leanest.vram_budget)} VRAM + {gib(leanest.ram_budget)} RAM are"
                  if card.has_gpu else f"{gib(leanest.ram_budget)} RAM is")
        need = (f": even with {leanest.settings.type_k} KV it needs "
                f"{gib(leanest.ram_used + leanest.vram_used)} (weights {gib(weights)}, KV "
                f"{gib(kv)}) but {usable} usable")
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
