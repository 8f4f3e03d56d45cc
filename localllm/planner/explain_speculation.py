"""The plan's reasons about speculative decoding: whether it drafts, how, what a checking pass
costs on its placement and the speed with and without; when it does not, why not."""

from __future__ import annotations

from localllm.modelstore.shape import ModelShape
from localllm.speculative import mode as mode_row

from . import speculation
from .card import Card
from .evaluator import Evaluator
from .memory import CPU
from .search import Option, Request, Search
from .checking import checking_terms
from .words import describe_placement, gib, tps
from .workload import objective_depth

SPECULATION = "speculation: "
SPECULATION_OFF = "speculation off: "
TYPICAL_CHECK = 4  # tokens of the checking pass quoted when speculation is off (3 drafts)


def _acceptance_text(choice) -> str:
    return f"{choice.acceptance:.2f} acceptance ({'measured' if choice.measured else 'assumed'})"


def _cpu_blocks_text(n: int) -> str:
    return f"with {n} blocks read on the CPU" if n else "with every block on the GPU"


def speculation_lines(shape: ModelShape, card: Card, request: Request, chosen: Search,
                      evaluator: Evaluator, notes: list[str]) -> list[str]:
    """Whether the plan drafts, how, what a checking pass costs on its placement and the speed
    with and without; when it does not, why not (a pass too costly, or no room)."""
    best = chosen.best
    assert best is not None
    if not request.speculation:
        return [f"{SPECULATION_OFF}not allowed by the request"]
    if not evaluator.speculators:
        return [f"{SPECULATION_OFF}{n}" for n in notes] or [
            f"{SPECULATION_OFF}no way of drafting planned for this model"]
    s, p = best.settings, best.placement
    depth = min(s.n_ctx, objective_depth(s.n_ctx, request.workload))
    terms = checking_terms(evaluator.costs, p, s, card, request.n_threads, depth,
                           request.expert_pool)
    on_cpu = speculation.cpu_blocks(evaluator.costs, p, card)
    out = []
    choice = best.speculation
    if choice is not None:
        k = choice.draft_n_max
        what = f"{choice.mode}, drafts up to {k}"
        if mode_row(choice.mode).draft_model and best.speculator is not None:
            what += (f" from {best.speculator.draft_name} ({choice.draft_n_gpu_layers} of its "
                     "layers on the GPU)" if choice.draft_n_gpu_layers else
                     f" from {best.speculator.draft_name} (in RAM)")
        out.append(f"{SPECULATION}{what}; checking {k + 1} tokens costs "
                   f"{choice.check_ratio:.1f}x one on this placement "
                   f"({_cpu_blocks_text(on_cpu)}); expected {_acceptance_text(choice)} -> "
                   f"predicted {tps(best.speed.decode_tps)} vs {tps(choice.plain_tps)} plain")
        extra = speculation.drafter_memory(best.speculator, p, s, card) \
            if best.speculator is not None else ()
        vram = sum(m.total for m in extra if m.device != CPU)
        ram = sum(m.total for m in extra if m.device == CPU)
        if extra:
            holder = "the NextN block, its KV and context" if mode_row(choice.mode).nextn else \
                "the draft model's weights, KV and context"
            out.append(f"{SPECULATION}{holder} take {gib(vram)} VRAM and {gib(ram)} RAM, "
                       "counted in the budget above")
        plain = [o for o in chosen.options if o.fits and o.speculation is None]
        plain_best, _ = evaluator.select(plain)
        if plain_best is not None and (plain_best.placement, plain_best.kv) != (p, best.kv):
            out.append(f"{SPECULATION}without it the search would choose "
                       f"{describe_placement(plain_best, shape)} with {plain_best.kv} KV at "
                       f"{tps(plain_best.speed.decode_tps)}; drafting makes this placement "
                       "the faster")
    else:
        plain_tps = best.speed.decode_tps
        for mode in dict.fromkeys(x.mode for x in evaluator.speculators):
            out.append(SPECULATION_OFF + _why_not(mode, best, chosen, evaluator, terms, on_cpu,
                                                  plain_tps))
    return out + [f"{SPECULATION}{n}" for n in notes]


def _why_not(mode: str, best: Option, chosen: Search, evaluator: Evaluator, terms, on_cpu: int,
             plain_tps: float) -> str:
    """Why drafting by `mode` lost: on the chosen placement (when the drafter fits beside it)
    the checking pass costs too much; else the best placement that holds the drafter is slower."""
    p, s = best.placement, best.settings
    if best.disk_bytes:
        return f"{mode}: weights are read from disk on every token; drafting is not planned there"
    here = [o for o in (evaluator.option(p, s, x) for x in evaluator.speculators
                        if x.mode == mode) if o.fits and o.speculation is not None]
    margin = f"it must gain {speculation.SPECULATION_MARGIN - 1:.0%}"
    if here:
        o = max(here, key=lambda o: o.speed.decode_tps)
        c = o.speculation
        assert c is not None
        return (f"{mode}: checking {TYPICAL_CHECK} tokens costs {terms.ratio(TYPICAL_CHECK):.1f}x "
                f"one {_cpu_blocks_text(on_cpu)}; at {_acceptance_text(c)} drafting would give "
                f"at best {tps(c.tps)} (drafts up to {c.draft_n_max}) vs {tps(plain_tps)} plain "
                f"({margin})")
    elsewhere = [o for o in chosen.options if o.speculator is not None
                 and o.speculator.mode == mode and o.fits and o.speculation is not None]
    if not elsewhere:
        return f"{mode}: the drafter does not fit in the budget with any placement tried"
    o = max(elsewhere, key=lambda o: o.speed.decode_tps)
    c = o.speculation
    assert c is not None
    n_cpu = speculation.cpu_blocks(evaluator.costs, o.placement, evaluator.card)
    return (f"{mode}: it does not fit beside this placement; the best placement that holds it "
            f"({o.kv} KV, n_gpu_layers={o.placement.n_gpu_layers}, {n_cpu} blocks read on the "
            f"CPU) checks {c.draft_n_max + 1} tokens at {c.check_ratio:.1f}x one and would "
            f"give {tps(c.tps)} (vs {tps(c.plain_tps)} there without drafting) against "
            f"{tps(plain_tps)} for this plan")
