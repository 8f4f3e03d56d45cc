"""The tuner: the best plan for this model on this card, found by search over predicted costs.

One pure function, `tune(shape, card, request, compute) -> Plan`. It reads top to bottom in the
order it works: for each context it tries, for each KV type and ubatch, it finds the placements
that fill the card (the most blocks on the GPU; the lm-head kept on the CPU; for MoE the experts
of the first blocks on the CPU), predicts their memory per device and their speed, keeps those
that fit the card and the host, and picks the fastest decode; a near tie (within 1%) goes to
the better KV precision, then to faster prefill. Measurements (dry-run compute buffers, NVML's
free memory) come in through the `Card` and the `ComputeTable`, so every test can call it with
numbers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from localllm.errors import UserError
from localllm.modelstore.shape import ModelShape

from .card import GIB, MIB, Card
from .explain import explain, gib, impossible_message
from .memory import (
    CPU, GPU_KV_TYPES, ComputeTable, ContextSettings, ModelCosts, Placement, memory_by_device,
    model_costs,
)
from .plan import DeviceMemory, Plan, TensorOverride, cpu_plan
from .speed import Speed, predict_speed

MIN_DEFAULT_CTX = 4096
CTX_LADDER = (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
NEAR_TIE = 0.99  # decode within 1%: below what the speed model can tell apart
FAST_ENOUGH = 0.9  # the default context may cost at most 10% of decode speed


class NoPlanFits(UserError):
    """The model cannot run as asked on this card and host; the message says what would."""


@dataclass(frozen=True)
class Request:
    """What the user asked for; None lets the tuner choose."""

    n_ctx: int | None = None
    margin_bytes: int = 512 * MIB  # VRAM left free on each GPU (config vram_margin_mib)
    kv_types: tuple[str, ...] = GPU_KV_TYPES
    n_gpu_layers: int | None = None  # Ollama's num_gpu
    n_threads: int | None = None  # num_thread
    n_batch: int | None = None  # num_batch
    ubatch_sizes: tuple[int, ...] = (512, 256)


@dataclass(frozen=True)
class Option:
    """One evaluated configuration: a placement at some context settings, and what it costs."""

    placement: Placement
    settings: ContextSettings
    memory: tuple[DeviceMemory, ...]
    speed: Speed
    vram_budget: int  # per GPU
    ram_budget: int

    @property
    def gpu_fits(self) -> bool:
        return all(m.total <= self.vram_budget for m in self.memory if m.device != CPU)

    @property
    def ram_fits(self) -> bool:
        return self.ram_used <= self.ram_budget

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.ram_fits

    @property
    def vram_used(self) -> int:
        return max((m.total for m in self.memory if m.device != CPU), default=0)

    @property
    def ram_used(self) -> int:
        return sum(m.total for m in self.memory if m.device == CPU)


@dataclass(frozen=True)
class Search:
    """Everything the search saw at one context: the winner and the alternatives."""

    n_ctx: int
    best: Option | None
    options: tuple[Option, ...] = field(default=())


def vram_budget(card: Card, margin: int) -> int:
    """Per GPU: free memory less the user's margin (the CUDA overhead is counted per device)."""
    return max(0, card.free_vram_bytes - margin) if card.has_gpu else 0


def ram_budget(card: Card) -> int:
    """Host RAM the plan may use: the system keeps 10% and at least 2 GiB for itself."""
    return max(0, card.ram_bytes - max(2 * GIB, card.ram_bytes // 10))


def _largest(pred: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Largest n in [lo, hi] with pred(n), pred true up to some n and false after."""
    if not pred(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pred(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _smallest(pred: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """Smallest n in [lo, hi] with pred(n), pred false up to some n and true after."""
    if not pred(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


class _Evaluator:
    def __init__(self, costs: ModelCosts, card: Card, request: Request,
                 compute: ComputeTable | None):
        self.costs, self.card, self.request, self.compute = costs, card, request, compute
        self.vram_budget = vram_budget(card, request.margin_bytes)
        self.ram_budget = ram_budget(card)

    def option(self, placement: Placement, settings: ContextSettings) -> Option:
        memory = memory_by_device(self.costs, placement, settings, self.card, self.compute)
        speed = predict_speed(self.costs, placement, settings, self.card, self.request.n_threads)
        return Option(placement, settings, memory, speed, self.vram_budget, self.ram_budget)

    def placements(self, settings: ContextSettings) -> list[Option]:
        """The placements worth comparing at these settings, each filling the GPU its way."""
        costs, n_all = self.costs, self.costs.n_blocks + 1
        if not self.card.has_gpu:
            return [self.option(Placement(0), settings)]
        if self.request.n_gpu_layers is not None:
            return [self.option(Placement(min(self.request.n_gpu_layers, n_all)), settings)]

        def gpu_fits(p: Placement) -> bool:
            return self.option(p, settings).gpu_fits

        out = []
        layers = _largest(lambda n: gpu_fits(Placement(n)), 0, n_all)
        out.append(self.option(Placement(layers or 0), settings))
        if layers is not None and layers < n_all and costs.output_bytes:
            # Keeping the lm-head in RAM frees room for blocks; it pays only when those blocks
            # would otherwise be read from RAM too.
            n = _largest(lambda n: gpu_fits(Placement(n, output_on_cpu=True)), 1, n_all)
            if n is not None and n > layers:
                out.append(self.option(Placement(n, output_on_cpu=True), settings))
        if costs.has_experts and (layers is None or layers < n_all):
            # Experts are most of an MoE model but few are read per token: keep attention and
            # shared weights of every block on the GPU and the experts of the first blocks in RAM.
            k = _smallest(lambda k: gpu_fits(Placement(n_all, n_cpu_expert_layers=k)),
                          0, costs.n_blocks)
            if k is not None:
                out.append(self.option(Placement(n_all, n_cpu_expert_layers=k), settings))
            else:
                n = _largest(lambda n: gpu_fits(Placement(n, n_cpu_expert_layers=costs.n_blocks)),
                             0, n_all)
                if n:
                    out.append(self.option(
                        Placement(n, n_cpu_expert_layers=costs.n_blocks), settings))
        return out

    def search(self, n_ctx: int, kv_types: tuple[str, ...] | None = None) -> Search:
        options: list[Option] = []
        gpu = self.card.has_gpu
        kv_types = (kv_types or self.request.kv_types) if gpu else ("f16",)
        ubatches = sorted({min(ub, n_ctx) for ub in (self.request.ubatch_sizes if gpu else (512,))},
                          reverse=True)
        for kv in kv_types:
            for ub in ubatches:
                # Flash attention on the GPU: a quantized V needs it, and it keeps the compute
                # buffer from growing with n_ctx x n_head. The CPU-only plan keeps llama.cpp's
                # defaults (see cpu_plan).
                settings = ContextSettings(n_ctx, kv, kv, flash_attn=gpu, n_ubatch=ub)
                options.extend(self.placements(settings))
        feasible = [o for o in options if o.fits]
        if self.request.n_gpu_layers is not None and not feasible:
            feasible = [o for o in options if o.ram_fits]  # the user's num_gpu is honoured
        return Search(n_ctx, pick(feasible), tuple(options))


def kv_rank(kv_type: str) -> int:
    """Lower is more precise."""
    return GPU_KV_TYPES.index(kv_type) if kv_type in GPU_KV_TYPES else len(GPU_KV_TYPES)


def pick(options: list[Option]) -> Option | None:
    if not options:
        return None
    fastest = max(o.speed.decode_tps for o in options)
    near = [o for o in options if o.speed.decode_tps >= fastest * NEAR_TIE]
    return min(near, key=lambda o: (kv_rank(o.settings.type_k), -o.speed.prefill_tps,
                                    o.vram_used))


def context_ladder(trained: int, wanted: int | None) -> list[int]:
    if wanted:
        return [min(wanted, trained) if trained else wanted]
    if not trained:
        return [MIN_DEFAULT_CTX]
    ladder = [c for c in CTX_LADDER if c < trained]
    return (ladder or []) + [trained] if trained > MIN_DEFAULT_CTX else [trained]


def tune(shape: ModelShape, card: Card, request: Request | None = None,
         compute: ComputeTable | None = None) -> Plan:
    """The plan with the best predicted decode speed that fits; NoPlanFits says what would."""
    request = request or Request()
    if request.n_ctx is not None and request.n_ctx < 256:
        raise NoPlanFits(f"context {request.n_ctx} is too small: use at least 256")
    costs = model_costs(shape)
    evaluator = _Evaluator(costs, card, request, compute)
    trained = shape.context_length
    if not card.has_gpu and request.n_ctx is None:
        # Without a GPU every context costs host RAM and slows the CPU's attention: start small.
        ladder = [min(MIN_DEFAULT_CTX, trained) if trained else MIN_DEFAULT_CTX]
    else:
        ladder = context_ladder(trained, request.n_ctx)
    searches = [evaluator.search(ladder[0])]
    if searches[0].best is not None and len(ladder) > 1:
        # A default context never costs KV precision: larger contexts are tried with KV types
        # at least as precise as the smallest context's best plan uses.
        rank = kv_rank(searches[0].best.settings.type_k)
        kv_types = tuple(t for t in request.kv_types if kv_rank(t) <= rank)
        searches += [evaluator.search(n, kv_types) for n in ladder[1:]]
    else:
        searches += [evaluator.search(n) for n in ladder[1:]]
    chosen = choose_context(searches)
    if chosen is None:
        raise NoPlanFits(impossible_message(shape, card, request, searches, evaluator.search))
    return build_plan(shape, card, request, chosen, searches, evaluator)


def choose_context(searches: list[Search]) -> Search | None:
    """The largest context whose best plan keeps decode within 10% of the smallest context's
    (with one search, that one)."""
    fitting = [s for s in searches if s.best is not None]
    if not fitting:
        return None
    if len(searches) == 1:
        return fitting[0]
    base = fitting[0].best.speed.decode_tps
    fast = [s for s in fitting if s.best.speed.decode_tps >= base * FAST_ENOUGH]
    return fast[-1]


def tensor_overrides(shape: ModelShape, placement: Placement) -> tuple[TensorOverride, ...]:
    out = []
    if placement.output_on_cpu:
        # With tied embeddings the lm-head is the token table loaded a second time.
        name = "token_embd" if shape.tied_embeddings else "output"
        out.append(TensorOverride(rf"^{name}\.weight$", "CPU"))
    if placement.n_cpu_expert_layers:
        blocks = "|".join(str(i) for i in range(placement.n_cpu_expert_layers))
        out.append(TensorOverride(rf"^blk\.({blocks})\.ffn_(up|down|gate|gate_up)_exps\.", "CPU"))
    return tuple(out)


def build_plan(shape: ModelShape, card: Card, request: Request, chosen: Search,
               searches: list[Search], evaluator: _Evaluator) -> Plan:
    best = chosen.best
    assert best is not None
    threads = request.n_threads or card.cores
    if not card.has_gpu:
        base = cpu_plan(best.settings.n_ctx, 0)
        batch = min(request.n_batch or base.n_batch, best.settings.n_ctx)
        plan = replace(base, n_threads=threads, n_batch=batch, n_ubatch=min(base.n_ubatch, batch),
                       n_threads_batch=request.n_threads or base.n_threads_batch)
    else:
        s = best.settings
        plan = Plan(
            n_ctx=s.n_ctx,
            n_gpu_layers=best.placement.n_gpu_layers,
            tensor_overrides=tensor_overrides(shape, best.placement),
            tensor_split=tuple(1.0 for _ in range(card.n_gpus)) if card.n_gpus > 1 else (),
            type_k=s.type_k, type_v=s.type_v, flash_attn=s.flash_attn, swa_full=s.swa_full,
            n_batch=request.n_batch or max(2048, s.n_ubatch),
            n_ubatch=min(s.n_ubatch, request.n_batch or s.n_ubatch),
            n_threads=threads, n_threads_batch=threads,
        )
    return replace(
        plan,
        memory=best.memory,
        predicted_decode_tps=round(best.speed.decode_tps, 2),
        predicted_prefill_tps=round(best.speed.prefill_tps, 1),
        reasons=tuple(explain(shape, card, request, chosen, searches, evaluator.option, threads)),
        source="tuner",
    )


__all__ = ["NoPlanFits", "Option", "Request", "Search", "gib", "tune"]
