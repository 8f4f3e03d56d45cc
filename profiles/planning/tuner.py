"""The tuner: the best plan for this model on this card, found by search over predicted costs.

One pure function, `tune(shape, card, request, compute) -> Plan`. It reads top to bottom in the
order it works: for each context it tries, for each KV setting and ubatch, it finds the
placements that fill the card (the most whole blocks on the GPU; the lm-head kept on the CPU;
every block's attention and KV on the GPU with the FFN of the last blocks in RAM, alone or mixed
with whole blocks; for MoE the experts of the first blocks on the CPU), predicts their memory per
device and the time of a whole session of the workload (profiles.workload: each turn's prompt
read in micro-batches at the depth the context has reached, each answer decoded at its depth),
keeps those that fit the card and the host, and lets the quality policy say which KV settings
may compete (profiles.quality). The shortest session wins; a near tie (within 1%) goes to the
better KV precision, then to faster prefill. Slots (`num_parallel`) and a full-size
sliding-window cache then take what VRAM is left, never a layer. Measurements (dry-run compute
buffers, NVML's free memory, `localllm eval` results) come in through the `Card`, the
`ComputeTable` and the `Request`, so every test can call it with numbers. What the card
leaves a plan (VRAM per GPU, RAM) is profiles.budgets; the winner becomes a Plan, with its
load parameters, predictions and reasons, in profiles.build.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from localllm.errors import UserError
from localllm.modelstore.shape import ModelShape

from . import quality, speculation
from .card import MIB, Card
from .disk import disk_bytes_per_token, disk_read_gbs, non_weight_ram_fits, with_disk_reads
from .budgets import Layout, gpu_layouts, ram_budget, vram_budget, vram_budgets
from .build import build_plan
from .explain import gib, impossible_message, seconds
from .memory import (
    CPU, ComputeTable, ContextSettings, ModelCosts, Placement, block_devices, layer_gpu_bytes,
    memory_by_device, model_costs, split_layers,
)
from .plan import DeviceMemory, Plan
from .quality import kv_label, kv_rank, split_kv
from .speculation import SpeculationChoice, Speculator
from .speed import (
    DEFAULT_UBATCH, PROMPT_FLOOR, Speed, below_prompt_floor, long_prompt, predict_speed,
    prompt_cost, prompt_seconds,
)
from .workload import HALF_FILL, Turn, Workload, objective_depth

MIN_DEFAULT_CTX = 4096
CTX_LADDER = (4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576)
NEAR_TIE = 0.99  # a session within 1%: below what the speed model can tell apart
FIRST_PROMPT_SLACK = 1.25  # a band entered by a long prompt reads it within this of the fastest
FAST_ENOUGH = 0.9  # the default context may cost at most 10% of decode speed
AUTO_MAX_PARALLEL = 4  # num_parallel = auto: at most this many slots
MIX_POINTS = 10  # whole-block counts tried under the attention-on-GPU placement
# K = V pairs the CUDA build runs inside flash attention; a mixed pair (q8_0 K / q4_0 V) would
# run attention on the CPU, so on a GPU it is left out (see explain's KV line).
GPU_KV_SETTINGS = tuple(t for t in quality.KV_LADDER if "/" not in t)


class NoPlanFits(UserError):
    """The model cannot run as asked on this card and host; the message says what would."""


@dataclass(frozen=True)
class Request:
    """What the user asked for; None lets the tuner choose."""

    n_ctx: int | None = None
    margin_bytes: int = 512 * MIB  # VRAM left free on each GPU (config vram_margin_mib)
    kv_types: tuple[str, ...] | None = None  # KV settings pinned (config kv_cache_type)
    n_gpu_layers: int | None = None  # Ollama's num_gpu
    n_threads: int | None = None  # num_thread
    n_batch: int | None = None  # num_batch
    # Micro-batches compared: bigger ones read a prompt faster where weights in RAM cross to
    # the GPU per micro-batch, and take a bigger compute buffer.
    ubatch_sizes: tuple[int, ...] = (2048, 1024, 512, 256)
    quality: str = quality.DEFAULT_POLICY  # config quality: max, balanced, speed
    measured_kl: Mapping[str, float] = field(default_factory=dict)  # `localllm eval` results
    # The session planned for. The daemon and `tune` pass the config's (workload, chat by
    # default, or the older expected_fill); a bare Request keeps the older half-fill objective.
    workload: Workload = HALF_FILL
    workload_source: str = ""  # where the workload came from: the record, a route, the config
    # The session opens with a prompt someone waits on (a fill band entered by a long prompt):
    # plans that read it slower than FIRST_PROMPT_SLACK times the fastest are set aside.
    first_prompt_waits: bool = False
    ram_budget_bytes: int | None = None  # config ram_budget; None: what the card has available
    num_parallel: int | None = 1  # slots: a cap; None = auto (as many as fit, at most 4)
    ffn_split: bool = True  # may a block's FFN sit in RAM apart from its attention
    # Measured acceptance per speculative mode ("mtp", "draft", "lookup"); others are assumed
    # (profiles.speculation.ASSUMED_ACCEPTANCE).
    acceptance: Mapping[str, float] = field(default_factory=dict)
    speculation: bool = True  # may the plan turn speculative decoding on
    # The smallest context a plan chosen without n_ctx gets (config default_ctx under the
    # `fit` policy): the tuner goes larger only where that costs no speed.
    min_ctx: int = MIN_DEFAULT_CTX


@dataclass(frozen=True)
class Option:
    """One evaluated configuration: a placement at some context settings, and what it costs."""

    placement: Placement
    settings: ContextSettings
    memory: tuple[DeviceMemory, ...]
    speed: Speed  # decode averaged over the session's answers (prefill: one micro-batch)
    vram_budget: int  # per GPU (several GPUs: the smallest; device_budgets has each)
    ram_budget: int
    disk_bytes: int = 0  # weights read from disk per token: past RAM, they stay mmapped
    # Speculative decoding: how it drafts (None: plain decode) and what it was priced at; the
    # memory above includes the drafter's and the speed is the speculative one.
    speculator: Speculator | None = None
    speculation: SpeculationChoice | None = None
    session: SessionTime | None = None  # the workload's session on this option
    device_budgets: tuple[tuple[str, int], ...] = ()  # several GPUs: each one's usable VRAM

    @property
    def session_seconds(self) -> float:
        return self.session.total if self.session is not None else float("inf")

    @property
    def pays(self) -> bool:
        """Plain decode, or speculation that beats plain decode on this placement."""
        return self.speculation is None or self.speculation.pays

    @property
    def kv(self) -> str:
        return kv_label(self.settings.type_k, self.settings.type_v)

    @property
    def gpu_fits(self) -> bool:
        budgets = dict(self.device_budgets)
        return all(m.total <= budgets.get(m.device, self.vram_budget)
                   for m in self.memory if m.device != CPU)

    @property
    def ram_fits(self) -> bool:
        """Weights past the RAM budget are read from the mmapped file (profiles.disk); what is
        allocated (KV, compute buffers) must fit."""
        return non_weight_ram_fits(self.memory, self.ram_budget)

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.ram_fits

    @property
    def vram_used(self) -> int:
        return max((m.total for m in self.memory if m.device != CPU), default=0)

    @property
    def ram_used(self) -> int:
        return sum(m.total for m in self.memory if m.device == CPU)

    @property
    def kv_on_gpu(self) -> bool:
        """Every block's KV (so its attention) is on a GPU."""
        return any(m.device != CPU for m in self.memory) and \
            not any(m.kv for m in self.memory if m.device == CPU)


@dataclass(frozen=True)
class SessionTime:
    """A session of the workload on one option: seconds reading prompts and decoding, per turn."""

    turns: tuple[Turn, ...]
    prompt_seconds: tuple[float, ...]
    decode_seconds: tuple[float, ...]

    @property
    def total(self) -> float:
        return sum(self.prompt_seconds) + sum(self.decode_seconds)

    @property
    def prompt_total(self) -> float:
        return sum(self.prompt_seconds)

    @property
    def decode_total(self) -> float:
        return sum(self.decode_seconds)

    @property
    def decode_tps(self) -> float:
        answered = sum(t.answer for t in self.turns)
        return answered / self.decode_total if self.decode_total > 0 else 0.0


@dataclass(frozen=True)
class Search:
    """Everything the search saw at one context: the winner, the alternatives, and what the
    quality policy did (a sentence, empty when it simply allowed the winner)."""

    n_ctx: int
    best: Option | None
    options: tuple[Option, ...] = field(default=())
    quality_note: str = ""
    prompt_note: str = ""  # what the prompt-reading floor did (speed.below_prompt_floor)


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
                 compute: ComputeTable | None, speculators: tuple[Speculator, ...] = ()):
        self.costs, self.card, self.request, self.compute = costs, card, request, compute
        self.vram_budget = vram_budget(card, request.margin_bytes)
        self.budgets = vram_budgets(card, request.margin_bytes)
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
                              depth)
        disk = self.disk_bytes(self.memory(placement, settings))
        return with_disk_reads(speed, disk, self.card, settings.n_ubatch)

    def speculative(self, placement: Placement, settings: ContextSettings, depth: int,
                    spec: Speculator) -> tuple[Speed, SpeculationChoice]:
        return speculation.speculative_speed(spec, self.costs, placement, settings, self.card,
                                             self.request.n_threads, depth)

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

    def session_time(self, option: Option) -> SessionTime:
        """The workload's session on this option: each turn's prompt read in whole
        micro-batches after the context so far (weights in RAM, and those read from disk,
        cross once per micro-batch), each answer decoded at its depth. Decode time per token
        is linear in depth between the points it is priced at."""
        s = option.settings
        turns = self.request.workload.session(s.n_ctx)
        cost = prompt_cost(self.costs, option.placement, s, self.card, self.request.n_threads)
        disk_s = option.disk_bytes / (disk_read_gbs(self.card)[0] * 1e9) if option.disk_bytes \
            else 0.0
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
        costs, n_all = self.costs, self.costs.n_blocks + 1
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

        def fit(p: Placement) -> Placement | None:
            return self.placed(p, settings, spec, layout)

        def fits(p: Placement) -> bool:
            return fit(p) is not None

        def option(p: Placement) -> Option:
            return self.option(fit(p) or p, settings, spec)

        out = []
        layers = _largest(lambda n: fits(Placement(n)), 0, n_all)
        out.append(option(Placement(layers or 0)))
        if layers is not None and layers < n_all and costs.output_bytes:
            # Keeping the lm-head in RAM frees room for blocks; it pays only when those blocks
            # would otherwise be read from RAM too.
            n = _largest(lambda n: fits(Placement(n, output_on_cpu=True)), 1, n_all)
            if n is not None and n > layers:
                out.append(option(Placement(n, output_on_cpu=True)))
        if costs.has_experts and (layers is None or layers < n_all):
            # Experts are most of an MoE model but few are read per token: keep attention and
            # shared weights of every block on the GPU and the experts of the first blocks in RAM.
            k = _smallest(lambda k: fits(Placement(n_all, n_cpu_expert_layers=k)),
                          0, costs.n_blocks)
            if k is not None:
                out.append(option(Placement(n_all, n_cpu_expert_layers=k)))
            else:
                n = _largest(lambda n: fits(Placement(n, n_cpu_expert_layers=costs.n_blocks)),
                             0, n_all)
                if n:
                    out.append(option(Placement(n, n_cpu_expert_layers=costs.n_blocks)))
        elif any(costs.ffn_bytes) and self.request.ffn_split and (layers is None
                                                                   or layers < n_all):
            out += self._ffn_splits(settings, layers or 0, spec, layout)
        return out

    def _ffn_splits(self, settings: ContextSettings, whole: int,
                    spec: Speculator | None = None,
                    layout: Layout | None = None) -> list[Option]:
        """Attention and KV on the GPU, the FFN of the fewest last blocks in RAM; mixed with
        whole blocks in RAM where the KV of every block does not fit. The whole-block counts
        are sampled, then the best is refined with its neighbours."""
        n_all, n_trunk = self.costs.n_blocks + 1, self.costs.n_trunk
        tried: dict[int, Option | None] = {}

        def at(n: int) -> Option | None:
            if n not in tried:
                k = _smallest(lambda k: self.placed(Placement(n, n_cpu_ffn_layers=k),
                                                    settings, spec, layout) is not None,
                              0, n_trunk)
                placed = self.placed(Placement(n, n_cpu_ffn_layers=k), settings, spec,
                                     layout) if k else None
                tried[n] = self.option(placed, settings, spec) if placed else None
            return tried[n]

        lo = whole + 1
        if lo > n_all:
            return []
        step = max(1, (n_all - lo) // MIX_POINTS)
        for n in range(n_all, lo - 1, -step):
            at(n)
        while step > 1:
            found = [o for o in tried.values() if o is not None]
            if not found:
                break
            best = min(found, key=lambda o: o.session_seconds).placement.n_gpu_layers
            step //= 2
            for n in (best - step, best + step):
                if lo <= n <= n_all:
                    at(n)
        return [o for o in tried.values() if o is not None]

    def kv_candidates(self) -> tuple[str, ...]:
        if self.request.kv_types:
            return self.request.kv_types
        return GPU_KV_SETTINGS if self.card.has_gpu else ("f16",)

    def search(self, n_ctx: int, kv_types: tuple[str, ...] | None = None) -> Search:
        options: list[Option] = []
        gpu = self.card.has_gpu
        ubatches = sorted({min(ub, n_ctx) for ub in (self.request.ubatch_sizes if gpu else (512,))},
                          reverse=True)
        for kv in kv_types or self.kv_candidates():
            type_k, type_v = split_kv(kv)
            for ub in ubatches:
                # Flash attention everywhere: a quantized V needs it, it keeps the compute buffer
                # from growing with n_ctx x n_head, and on the CPU it is faster too (SmolLM2 on
                # 2 cores, llama_decode: 131 vs 93 tok/s for one sequence, 211 vs 140 for four).
                settings = ContextSettings(n_ctx, type_k, type_v, flash_attn=True, n_ubatch=ub)
                plain = self.placements(settings)
                options.extend(plain)
                options.extend(self.speculative_options(settings, plain))
        feasible = [o for o in options if o.fits and o.pays]
        if self.request.n_gpu_layers is not None and not feasible:
            # the user's num_gpu is honoured
            feasible = [o for o in options if o.ram_fits and o.pays]
        feasible, prompt_note = self.prompt_floor(feasible, n_ctx)
        if self.request.first_prompt_waits:
            feasible = self.reading_first(feasible)
        best, note = self.select(feasible)
        if best is not None and best.speculation is not None:
            # Speculation has to beat the best plan without it, not only its own placement.
            plain_best, plain_note = self.select([o for o in feasible if o.speculation is None])
            if plain_best is not None and best.session_seconds * \
                    speculation.SPECULATION_MARGIN > plain_best.session_seconds:
                best, note = plain_best, plain_note
        if best is not None and prompt_note:
            prompt_note = prompt_note.format(ttft=seconds(self.long_prompt_seconds(best)),
                                             ub=best.settings.n_ubatch)
        return Search(n_ctx, best, tuple(options), note, prompt_note)

    def long_prompt_seconds(self, option: Option, n_ubatch: int | None = None) -> float:
        """Seconds to read the floor's long prompt (speed.long_prompt) on this option."""
        s = option.settings
        cost = prompt_cost(self.costs, option.placement, s, self.card, self.request.n_threads)
        disk_s = option.disk_bytes / (disk_read_gbs(self.card)[0] * 1e9) if option.disk_bytes \
            else 0.0
        return prompt_seconds(cost, long_prompt(s.n_ctx), n_ubatch or s.n_ubatch, disk_s)

    def reading_first(self, feasible: list[Option]) -> list[Option]:
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

    def below_floor(self, option: Option) -> bool:
        s = option.settings
        if not self.card.has_gpu or s.n_ubatch >= DEFAULT_UBATCH:
            return False
        cost = prompt_cost(self.costs, option.placement, s, self.card, self.request.n_threads)
        disk_s = option.disk_bytes / (disk_read_gbs(self.card)[0] * 1e9) if option.disk_bytes \
            else 0.0
        return below_prompt_floor(cost, s.n_ctx, s.n_ubatch, disk_s)

    def prompt_floor(self, feasible: list[Option], n_ctx: int) -> tuple[list[Option], str]:
        """The options that read a long prompt within the floor (speed.below_prompt_floor), and
        a sentence for the plan's reasons where the floor decided (its {ttft} and {ub} filled
        in with the winner's); all of them, and why, where none does (VRAM cannot hold the
        larger micro-batch's compute buffer)."""
        slow = [o for o in feasible if self.below_floor(o)]
        if not slow:
            return feasible, ""
        n = long_prompt(n_ctx)
        reading = [o for o in feasible if o not in slow]
        if not reading:
            return feasible, (f"prompt reading: ubatch {{ub}} reads a {n}-token prompt in "
                              f"{{ttft}} to the first token: no plan with a micro-batch of "
                              f"{DEFAULT_UBATCH} fits (its compute buffer does not fit in VRAM "
                              "beside the weights)")
        faster, _ = self.select(feasible)
        if faster not in slow:
            return reading, ""  # the floor changed nothing the session preferred
        weights = next((m.weights for m in faster.memory if m.device == CPU), 0)
        return reading, (
            f"prompt reading: ubatch {{ub}} reads a {n}-token prompt in {{ttft}} to the first "
            f"token; ubatch {faster.settings.n_ubatch} (the plan otherwise chosen, session "
            f"{seconds(faster.session_seconds)}) would take "
            f"{seconds(self.long_prompt_seconds(faster))}: "
            f"{gib(weights)} of weights in RAM cross to the GPU once per micro-batch, "
            f"and a plan reads a long prompt at no less than {PROMPT_FLOOR:.0%} of the speed "
            f"of llama.cpp's default micro-batch ({DEFAULT_UBATCH}) whatever the workload")

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
    if request.n_ctx is not None and request.n_ctx < 256:
        raise NoPlanFits(f"context {request.n_ctx} is too small: use at least 256")
    if request.quality not in quality.POLICIES:
        raise NoPlanFits(f"quality must be one of {', '.join(quality.POLICIES)}, "
                         f"not {request.quality!r}")
    costs = model_costs(shape)
    speculators, speculation_notes = speculation.speculators(
        shape, costs, card, draft, request.acceptance) if request.speculation else ([], [])
    evaluator = _Evaluator(costs, card, request, compute, tuple(speculators))
    trained = shape.context_length
    if not card.has_gpu and request.n_ctx is None:
        # Without a GPU every context costs host RAM and slows the CPU's attention: start small.
        ladder = [min(request.min_ctx, trained) if trained else request.min_ctx]
    else:
        ladder = context_ladder(trained, request.n_ctx, request.min_ctx)
    searches = [evaluator.search(ladder[0])]
    if searches[0].best is not None and len(ladder) > 1:
        # A default context never costs KV precision: larger contexts are tried with KV types
        # at least as precise as the smallest context's best plan uses.
        rank = kv_rank(searches[0].best.kv)
        kv_types = tuple(t for t in evaluator.kv_candidates() if kv_rank(t) <= rank)
        searches += [evaluator.search(n, kv_types) for n in ladder[1:]]
    else:
        searches += [evaluator.search(n) for n in ladder[1:]]
    chosen = choose_context(searches, evaluator)
    if chosen is None:
        raise NoPlanFits(impossible_message(shape, card, request, searches, evaluator.search))
    return build_plan(shape, card, request, chosen, searches, evaluator, speculation_notes)


def choose_context(searches: list[Search], evaluator: _Evaluator) -> Search | None:
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


__all__ = ["NoPlanFits", "Option", "Request", "Search", "gib", "tune"]
