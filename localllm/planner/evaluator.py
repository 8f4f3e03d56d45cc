"""The search's prices: what a placement at some context settings costs on this card
(memory per device, decode and prefill speed, the workload's session), as an `Option`; which
options the quality policy lets win; and the slots and sliding-window cache that take what
VRAM the winner leaves. The placements worth pricing come from their kinds
(planner.placements); the search over contexts is planner.tuner.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import quality, speculation
from .budgets import Layout, gpu_layouts, ram_budget, vram_budget, vram_budgets
from .card import Card
from .costs import ModelCosts
from .disk import disk_bytes_per_token, disk_read_gbs, with_disk_reads
from .memory import (
    CPU, ComputeTable, ContextSettings, block_devices, layer_gpu_bytes, memory_by_device,
    split_layers,
)
from .placements import KINDS, Placement, largest
from .quality import kv_rank
from .search import Option, Request, SessionTime
from .speculation import SpeculationChoice, Speculator
from .speed import Speed, predict_speed, PromptCost, prompt_cost
from .workload import objective_depth

NEAR_TIE = 0.99  # a session within 1%: below what the speed model can tell apart
AUTO_MAX_PARALLEL = 4  # num_parallel = auto: at most this many slots
# K = V pairs the CUDA build runs inside flash attention; a mixed pair (q8_0 K / q4_0 V) would
# run attention on the CPU, so on a GPU it is left out (see explain's KV line).
GPU_KV_SETTINGS = tuple(t for t in quality.KV_LADDER if "/" not in t)


class Evaluator:
    """Prices options for one model, card and request: the search (tuner.search) asks it for
    the placements at some settings, each as an Option, and which of them wins."""

    def __init__(self, costs: ModelCosts, card: Card, request: Request,
                 compute: ComputeTable | None, speculators: tuple[Speculator, ...] = ()):
        self.costs, self.card, self.request, self.compute = costs, card, request, compute
        self.vram_budget = vram_budget(card, request.margin_bytes, request.reserved_vram_bytes)
        self.budgets = vram_budgets(card, request.margin_bytes, request.reserved_vram_bytes)
        self.device_budgets = tuple(self.budgets.items()) if card.n_gpus > 1 else ()
        # Several GPUs: each placement is tried under each layout (None: one GPU, no split)
        self.layouts: tuple[Layout | None, ...] = \
            gpu_layouts(card, self.budgets) if card.has_gpu and card.n_gpus > 1 else (None,)
        self.ram_budget = ram_budget(card, request)
        self.kv_costs = quality.kv_costs(request.measured_kl)
        # Per token only the routed experts are read, so only their share of a spill hits disk.
        self.read_fraction = costs.expert_active_fraction if costs.has_experts else 1.0
        self.speculators = speculators

    def memory(self, placement: Placement, settings: ContextSettings,
               spec: Speculator | None = None):
        if spec is not None and any(self.costs.state_bytes):
            # The runner keeps one recurrent-state snapshot per position a draft may take back
            # (llama.cpp's n_rs_seq = the longest draft + 1): priced at the longest tried.
            settings = replace(settings, n_rs_seq=max(spec.draft_lengths) + 1)
        memory = memory_by_device(self.costs, placement, settings, self.card, self.compute)
        if spec is not None and spec.needs_memory:
            memory = speculation.with_drafter(memory, speculation.drafter_memory(
                spec, placement, settings, self.card))
        return memory

    def gpu_fits(self, placement: Placement, settings: ContextSettings,
                 spec: Speculator | None = None) -> bool:
        return all(m.total <= self.budgets.get(m.device, self.vram_budget)
                   for m in self.memory(placement, settings, spec) if m.device != CPU)

    def placed(self, placement: Placement, settings: ContextSettings, spec: Speculator | None,
               layout: Layout | None) -> Placement | None:
        """The placement with its GPU layers split by the layout so that every GPU stays in its
        budget; None where no split does. One GPU: the placement itself, if it fits."""
        if layout is None:
            return placement if self.gpu_fits(placement, settings, spec) else None
        costs, n_all = self.costs, self.costs.n_blocks + 1
        n = max(0, min(placement.n_gpu_layers, n_all))
        per_layer = layer_gpu_bytes(costs, placement, settings)
        # What each GPU holds besides its layers (overhead, compute buffer, a drafter's share),
        # from a first split in proportion to the shares.
        first = replace(placement, n_gpu_layers=n, gpu_split=_proportional(n, layout.shares))
        devices = block_devices(costs, first, self.card.n_gpus)
        held = dict.fromkeys(self.card.devices, 0)
        for d, b in zip(devices, per_layer, strict=True):
            if d != CPU:
                held[d] += b
        memory = {m.device: m.total for m in self.memory(first, settings, spec)}
        rooms = [self.budgets[d] - (memory[d] - held[d]) for d in self.card.devices]
        split = split_layers(per_layer[n_all - n:], rooms, list(layout.shares))
        if split is None:
            return None
        out = replace(first, gpu_split=split)
        return out if self.gpu_fits(out, settings, spec) else None

    def disk_bytes(self, memory: tuple) -> int:
        return disk_bytes_per_token(memory, self.ram_budget, self.read_fraction)

    def speed(self, placement: Placement, settings: ContextSettings, depth: int,
              spec: Speculator | None = None) -> Speed:
        if spec is not None:
            return self.speculative(placement, settings, depth, spec)[0]
        speed = predict_speed(self.costs, placement, settings, self.card, self.request.n_threads,
                              depth, self.request.expert_pool)
        disk = self.disk_bytes(self.memory(placement, settings))
        return with_disk_reads(speed, disk, self.card, settings.n_ubatch)

    def speculative(self, placement: Placement, settings: ContextSettings, depth: int,
                    spec: Speculator) -> tuple[Speed, SpeculationChoice]:
        return speculation.speculative_speed(spec, self.costs, placement, settings, self.card,
                                             self.request.n_threads, depth,
                                             self.request.expert_pool)

    def option_speed(self, option: Option, depth: int) -> Speed:
        """An option's decode at another depth, drafting as it was planned to."""
        return self.speed(option.placement, option.settings, depth, option.speculator)

    def option(self, placement: Placement, settings: ContextSettings,
               spec: Speculator | None = None) -> Option:
        depth = objective_depth(settings.n_ctx, self.request.workload)
        memory = self.memory(placement, settings, spec)
        disk = self.disk_bytes(memory)
        if spec is None or disk:  # (weights read from disk: speculation is not priced there)
            return self.priced(Option(placement, settings, memory,
                                      self.speed(placement, settings, depth),
                                      self.vram_budget, self.ram_budget, disk_bytes=disk,
                                      device_budgets=self.device_budgets))
        speed, choice = self.speculative(placement, settings, depth, spec)
        # The draft length is chosen here, at the objective depth; later prices keep it.
        spec = replace(spec, draft_lengths=(choice.draft_n_max,))
        memory = self.memory(placement, settings, spec)
        return self.priced(Option(placement, settings, memory, speed, self.vram_budget,
                                  self.ram_budget, speculator=spec, speculation=choice,
                                  device_budgets=self.device_budgets))

    def priced(self, option: Option) -> Option:
        """The option with its session timed and its speed the session's averages."""
        session = self.session_time(option)
        speed = replace(option.speed, decode_tps=session.decode_tps or option.speed.decode_tps)
        return replace(option, session=session, speed=speed)

    def prompt_terms(self, option: Option) -> tuple[PromptCost, float]:
        """What reading a prompt costs on this option, and the seconds each micro-batch adds
        reading weights past RAM from the disk. Within RAM the plan loads its weights in RAM
        pinned (build.loads_pinned); past RAM the file stays mapped, and so do they."""
        cost = prompt_cost(self.costs, option.placement, option.settings, self.card,
                           self.request.n_threads, pinned=not option.disk_bytes)
        disk_s = option.disk_bytes / (disk_read_gbs(self.card)[0] * 1e9) if option.disk_bytes \
            else 0.0
        return cost, disk_s

    def session_time(self, option: Option) -> SessionTime:
        """The workload's session on this option: each turn's prompt read in whole
        micro-batches after the context so far (weights in RAM, and those read from disk,
        cross once per micro-batch), each answer decoded at its depth. Decode time per token
        is linear in depth between the points it is priced at."""
        s = option.settings
        turns = self.request.workload.session(s.n_ctx)
        cost, disk_s = self.prompt_terms(option)
        prompt = []
        for t in turns:
            n_ub = -(-t.prompt // max(1, s.n_ubatch)) if t.prompt else 0
            prompt.append(cost.seconds(t.prompt, s.n_ubatch, t.start) + n_ub * disk_s)
        end = max((t.end for t in turns), default=1)
        # Plain decode time is linear in depth (KV read and CPU attention grow with the cells),
        # so its two ends price it; a drafted pass is not, and gets its middle too.
        points = {0, end} if option.speculator is None else {0, end // 2, end}
        if self.costs.has_sliding and self.costs.sliding_window < end:
            points.add(self.costs.sliding_window)
        depths = sorted(points)
        per_token = [1.0 / max(1e-9, self.option_speed(option, d).decode_tps) for d in depths]

        def seconds_at(d: float) -> float:
            for (d0, s0), (d1, s1) in zip(zip(depths, per_token, strict=True),
                                          zip(depths[1:], per_token[1:], strict=True),
                                          strict=False):
                if d <= d1:
                    return s0 + (s1 - s0) * (d - d0) / max(1, d1 - d0)
            return per_token[-1]

        decode = [t.answer * seconds_at(t.start + t.prompt + t.answer / 2) for t in turns]
        return SessionTime(turns, tuple(prompt), tuple(decode))

    def placements(self, settings: ContextSettings,
                   spec: Speculator | None = None) -> list[Option]:
        """The placements worth comparing at these settings, each filling the GPUs its way
        (several GPUs: under each layout of them)."""
        out = []
        for layout in self.layouts:
            out += self._placements(settings, spec, layout)
        return out

    def _placements(self, settings: ContextSettings, spec: Speculator | None,
                    layout: Layout | None) -> list[Option]:
        n_all = self.costs.n_blocks + 1
        if not self.card.has_gpu:
            return [self.option(Placement(0), settings, spec)]
        if self.request.n_gpu_layers is not None:
            if layout is not None and layout is not self.layouts[0]:
                return []  # the user's num_gpu: split once, by free memory over every GPU
            asked = Placement(min(self.request.n_gpu_layers, n_all))
            if layout is not None:
                asked = self.placed(asked, settings, spec, layout) or replace(
                    asked, gpu_split=_proportional(asked.n_gpu_layers, layout.shares))
            return [self.option(asked, settings, spec)]
        trial = SearchAt(self, settings, spec, layout)
        whole = largest(lambda n: trial.fits(Placement(n)), 0, n_all)
        return [o for kind in KINDS
                for o in kind.candidates(trial, self.costs, whole, self.request.ffn_split)]

    def kv_candidates(self) -> tuple[str, ...]:
        if self.request.kv_types:
            return self.request.kv_types
        return GPU_KV_SETTINGS if self.card.has_gpu else ("f16",)

    def speculative_options(self, settings: ContextSettings, plain: list[Option]) -> list[Option]:
        """Each way of drafting over the placements that fill the card with it: the plain
        placements re-priced where drafting needs no memory (lookup), else placements found
        again with the drafter's weights, KV and compute counted."""
        out = []
        for spec in self.speculators:
            if spec.needs_memory:
                out += self.placements(settings, spec)
            else:
                out += [self.option(o.placement, o.settings, spec) for o in plain]
        return out

    def select(self, feasible: list[Option]) -> tuple[Option | None, str]:
        """The fastest option the quality policy allows, and what the policy had to do."""
        if not feasible:
            return None, ""
        if self.request.kv_types:
            return pick(feasible), ""
        policy = self.request.quality
        allowed = quality.allowed(policy, self.kv_costs)
        within = [o for o in feasible if o.kv in allowed]
        if policy == "balanced" and self.card.has_gpu and within \
                and not any(o.kv_on_gpu for o in within):
            # 4 bits only where the more precise settings cannot keep the context's KV on the
            # GPU: there the cache's size, not its precision, decides the speed.
            extra = [o for o in feasible if o.kv not in allowed]
            best = pick(within + extra)
            if best is not None and best.kv not in allowed:
                return best, (f"{best.kv} KV: the more precise settings cannot keep this "
                              "context's KV on the GPU (balanced quality allows 4 bits only "
                              "then)")
            return best, ""
        if within:
            return pick(within), ""
        for label in quality.KV_LADDER:
            fitting = [o for o in feasible if o.kv == label]
            if fitting:
                return pick(fitting), (f"{label} KV: nothing within the {policy} quality "
                                       "policy fits")
        return pick(feasible), ""

    def with_slots(self, best: Option) -> tuple[Option, str]:
        """The most slots (each a full context of KV) that fit beside the chosen placement."""
        cap = self.request.num_parallel or AUTO_MAX_PARALLEL
        for n in range(cap, 1, -1):
            o = self.option(best.placement, replace(best.settings, n_seq=n), best.speculator)
            if o.fits and o.disk_bytes <= best.disk_bytes:  # a slot never costs disk reads
                return o, ""
        if cap > 1:
            where = "without moving weights off the GPU" if self.card.has_gpu else \
                "in the RAM budget"
            return best, f"a second slot does not fit {where}"
        return best, ""

    def with_full_swa(self, best: Option, chat: bool) -> Option | None:
        """A full-size sliding-window cache, where the VRAM left allows it (chat models)."""
        if not (chat and self.costs.has_sliding) or best.settings.swa_full:
            return None
        o = self.option(best.placement, replace(best.settings, swa_full=True), best.speculator)
        return o if o.fits and o.disk_bytes <= best.disk_bytes else None


@dataclass(frozen=True)
class SearchAt:
    """The search at one setting, as a placement kind sees it (placements.Trial): whether a
    placement fits the GPUs (split by the layout), and its option priced."""

    evaluator: Evaluator
    settings: ContextSettings
    spec: Speculator | None
    layout: Layout | None

    def fits(self, placement: Placement) -> bool:
        return self.evaluator.placed(placement, self.settings, self.spec,
                                     self.layout) is not None

    def price(self, placement: Placement) -> Option:
        placed = self.evaluator.placed(placement, self.settings, self.spec, self.layout)
        return self.evaluator.option(placed or placement, self.settings, self.spec)


def _proportional(n: int, shares: tuple[float, ...]) -> tuple[int, ...]:
    """n layers over the devices in proportion to the shares (largest remainders)."""
    total = sum(shares)
    if not total:
        return tuple(0 for _ in shares)
    exact = [n * s / total for s in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(shares)), key=lambda i: exact[i] - counts[i],
                    reverse=True)[:n - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def pick(options: list[Option]) -> Option | None:
    if not options:
        return None
    shortest = min(o.session_seconds for o in options)
    near = [o for o in options if o.session_seconds * NEAR_TIE <= shortest]
    return min(near, key=lambda o: (kv_rank(o.kv), o.speculation is not None,
                                    -o.speed.prefill_tps, o.vram_used))
