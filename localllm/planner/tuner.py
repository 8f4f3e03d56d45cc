"""The tuner: the best plan for this model on this card, found by search over predicted costs.

One pure function, `tune(shape, card, request, compute) -> Plan`. It reads top to bottom in the
order it works: for each context it tries, for each KV setting and ubatch, it finds the
placements that fill the card (the most whole blocks on the GPU; the lm-head kept on the CPU;
every block's attention and KV on the GPU with the FFN of the last blocks in RAM, alone or mixed
with whole blocks; for MoE the experts of the first blocks on the CPU), predicts their memory per
device and the time of a whole session of the workload (workload.py: each turn's prompt read
in micro-batches at the depth the context has reached, each answer decoded at its depth),
keeps those that fit the card and the host, and lets the quality policy say which KV settings
may compete (quality.py). The shortest session wins; a near tie (within 1%) goes to the
better KV precision, then to faster prefill. Slots (`num_parallel`) and a full-size
sliding-window cache then take what VRAM is left, never a layer. Measurements (dry-run compute
buffers, NVML's free memory, `localllm eval` results) come in through the `Card`, the
`ComputeTable` and the `Request`, so every test can call it with numbers. What the card
leaves a plan (VRAM per GPU, RAM) is budgets.py; each option's price is the
evaluator's (evaluator.py), the placements tried are their kinds' (placements.py); the winner
becomes a Plan, with its load parameters, predictions and reasons, in build.py.
"""

from __future__ import annotations

from localllm.modelstore.shape import ModelShape

from . import quality, speculation
from .build import build_plan
from .card import Card
from .costs import model_costs
from .evaluator import Evaluator
from .expert_pool import with_expert_pool
from .explain import impossible_message
from .memory import CPU, ComputeTable, ContextSettings
from .plan import Plan
from .quality import kv_rank, split_kv
from .search import MIN_DEFAULT_CTX, NoPlanFits, Option, Request, Search
from .speed import (
    DEFAULT_UBATCH, PROMPT_FLOOR, below_prompt_floor, long_prompt, prompt_seconds,
)
from .words import gib, seconds

CTX_LADDER = (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
FIRST_PROMPT_SLACK = 1.25  # a band entered by a long prompt reads it within this of the fastest
FAST_ENOUGH = 0.9  # the default context may cost at most 10% of decode speed


def search(evaluator: Evaluator, n_ctx: int, kv_types: tuple[str, ...] | None = None) -> Search:
    """Everything at one context: each KV setting and micro-batch, the placements of every
    kind, with and without drafting; the winner under the prompt floor and the quality
    policy."""
    options: list[Option] = []
    gpu = evaluator.card.has_gpu
    sizes = evaluator.request.ubatch_sizes if gpu else (512,)
    ubatches = sorted({min(ub, n_ctx) for ub in sizes}, reverse=True)
    for kv in kv_types or evaluator.kv_candidates():
        type_k, type_v = split_kv(kv)
        for ub in ubatches:
            # Flash attention everywhere: a quantized V needs it, it keeps the compute buffer
            # from growing with n_ctx x n_head, and on the CPU it is faster too (SmolLM2 on
            # 2 cores, llama_decode: 131 vs 93 tok/s for one sequence, 211 vs 140 for four).
            settings = ContextSettings(n_ctx, type_k, type_v, flash_attn=True, n_ubatch=ub)
            plain = evaluator.placements(settings)
            options.extend(plain)
            options.extend(evaluator.speculative_options(settings, plain))
    feasible = [o for o in options if o.fits and o.pays]
    if evaluator.request.n_gpu_layers is not None and not feasible:
        # the user's num_gpu is honoured
        feasible = [o for o in options if o.ram_fits and o.pays]
    feasible, prompt_note = prompt_floor(evaluator, feasible, n_ctx)
    if evaluator.request.first_prompt_waits:
        feasible = reading_first(feasible)
    best, note = evaluator.select(feasible)
    if best is not None and best.speculation is not None:
        # Speculation has to beat the best plan without it, not only its own placement.
        plain_best, plain_note = evaluator.select([o for o in feasible if o.speculation is None])
        if plain_best is not None and best.session_seconds * \
                speculation.SPECULATION_MARGIN > plain_best.session_seconds:
            best, note = plain_best, plain_note
    if best is not None and prompt_note:
        prompt_note = prompt_note.format(ttft=seconds(long_prompt_seconds(evaluator, best)),
                                         ub=best.settings.n_ubatch)
    return Search(n_ctx, best, tuple(options), note, prompt_note)


def long_prompt_seconds(evaluator: Evaluator, option: Option,
                        n_ubatch: int | None = None) -> float:
    """Seconds to read the floor's long prompt (speed.long_prompt) on this option."""
    s = option.settings
    cost, disk_s = evaluator.prompt_terms(option)
    return prompt_seconds(cost, long_prompt(s.n_ctx), n_ubatch or s.n_ubatch, disk_s)


def reading_first(feasible: list[Option]) -> list[Option]:
    """The options that read the session's first prompt within FIRST_PROMPT_SLACK of the
    fastest at their KV setting (so that the quality policy still chooses among settings):
    a band a long prompt enters is loaded while someone waits for that prompt's answer, and
    the session after it (decode, where the fastest reading costs some) is priced among
    them. On the H200 a band priced on the session alone read a 16K prompt at 393 tok/s
    where the agent's plan read 895 (issue 36)."""
    def first(o: Option) -> float:
        return o.session.prompt_seconds[0] if o.session and o.session.turns else 0.0

    fastest: dict[str, float] = {}
    for o in feasible:
        fastest[o.kv] = min(fastest.get(o.kv, float("inf")), first(o))
    return [o for o in feasible if first(o) <= fastest[o.kv] * FIRST_PROMPT_SLACK]


def below_floor(evaluator: Evaluator, option: Option) -> bool:
    s = option.settings
    if not evaluator.card.has_gpu or s.n_ubatch >= DEFAULT_UBATCH:
        return False
    cost, disk_s = evaluator.prompt_terms(option)
    return below_prompt_floor(cost, s.n_ctx, s.n_ubatch, disk_s)


def prompt_floor(evaluator: Evaluator, feasible: list[Option],
                 n_ctx: int) -> tuple[list[Option], str]:
    """The options that read a long prompt within the floor (speed.below_prompt_floor), and
    a sentence for the plan's reasons where the floor decided (its {ttft} and {ub} filled
    in with the winner's); all of them, and why, where none does (VRAM cannot hold the
    larger micro-batch's compute buffer)."""
    slow = [o for o in feasible if below_floor(evaluator, o)]
    if not slow:
        return feasible, ""
    n = long_prompt(n_ctx)
    reading = [o for o in feasible if o not in slow]
    if not reading:
        return feasible, (f"prompt reading: ubatch {{ub}} reads a {n}-token prompt in "
                          f"{{ttft}} to the first token: no plan with a micro-batch of "
                          f"{DEFAULT_UBATCH} fits (its compute buffer does not fit in VRAM "
                          "beside the weights)")
    faster, _ = evaluator.select(feasible)
    if faster not in slow:
        return reading, ""  # the floor changed nothing the session preferred
    weights = next((m.weights for m in faster.memory if m.device == CPU), 0)
    return reading, (
        f"prompt reading: ubatch {{ub}} reads a {n}-token prompt in {{ttft}} to the first "
        f"token; ubatch {faster.settings.n_ubatch} (the plan otherwise chosen, session "
        f"{seconds(faster.session_seconds)}) would take "
        f"{seconds(long_prompt_seconds(evaluator, faster))}: "
        f"{gib(weights)} of weights in RAM cross to the GPU once per micro-batch, "
        f"and a plan reads a long prompt at no less than {PROMPT_FLOOR:.0%} of the speed "
        f"of llama.cpp's default micro-batch ({DEFAULT_UBATCH}) whatever the workload")


def context_ladder(trained: int, wanted: int | None,
                   floor: int = MIN_DEFAULT_CTX) -> list[int]:
    if wanted:
        return [min(wanted, trained) if trained else wanted]
    if not trained:
        return [floor]
    if trained <= floor:
        return [trained]
    return [floor, *(c for c in CTX_LADDER if floor < c < trained), trained]


def tune(shape: ModelShape, card: Card, request: Request | None = None,
         compute: ComputeTable | None = None, draft: ModelShape | None = None) -> Plan:
    """The plan with the best predicted decode speed that fits; NoPlanFits says what would.

    `draft` is the shape of a draft model paired with this one (same vocabulary): the search
    then also prices speculative decoding with it, its weights and KV inside the budget."""
    request = request or Request()
    if request.expert_cache:  # the pool's VRAM first, then the placement around it
        return with_expert_pool(shape, card, request,
                                lambda plain: tune(shape, card, plain, compute, draft))
    if request.n_ctx is not None and request.n_ctx < 256:
        raise NoPlanFits(f"context {request.n_ctx} is too small: use at least 256")
    if request.quality not in quality.POLICIES:
        raise NoPlanFits(f"quality must be one of {', '.join(quality.POLICIES)}, "
                         f"not {request.quality!r}")
    costs = model_costs(shape)
    speculators, speculation_notes = speculation.speculators(
        shape, costs, card, draft, request.acceptance) if request.speculation else ([], [])
    evaluator = Evaluator(costs, card, request, compute, tuple(speculators))
    trained = shape.context_length
    if not card.has_gpu and request.n_ctx is None:
        # Without a GPU every context costs host RAM and slows the CPU's attention: start small.
        ladder = [min(request.min_ctx, trained) if trained else request.min_ctx]
    else:
        ladder = context_ladder(trained, request.n_ctx, request.min_ctx)
    searches = [search(evaluator, ladder[0])]
    if searches[0].best is not None and len(ladder) > 1:
        # A default context never costs KV precision: larger contexts are tried with KV types
        # at least as precise as the smallest context's best plan uses.
        rank = kv_rank(searches[0].best.kv)
        kv_types = tuple(t for t in evaluator.kv_candidates() if kv_rank(t) <= rank)
        searches += [search(evaluator, n, kv_types) for n in ladder[1:]]
    else:
        searches += [search(evaluator, n) for n in ladder[1:]]
    chosen = choose_context(searches, evaluator)
    if chosen is None:
        raise NoPlanFits(impossible_message(shape, card, request, searches,
                                            lambda n: search(evaluator, n)))
    return build_plan(shape, card, request, chosen, searches, evaluator, speculation_notes)


def choose_context(searches: list[Search], evaluator: Evaluator) -> Search | None:
    """The largest context whose best plan keeps decode within 10% of the smallest context's
    (with one search, that one). Compared at the start of the context, so that only what the
    larger cache costs the placement counts, not how deep a longer conversation gets."""
    fitting = [s for s in searches if s.best is not None]
    if not fitting:
        return None
    if len(searches) == 1:
        return fitting[0]
    def shallow(s: Search) -> float:
        return evaluator.option_speed(s.best, 0).decode_tps

    base = shallow(fitting[0])
    fast = [s for s in fitting if shallow(s) >= base * FAST_ENOUGH]
    return fast[-1]
