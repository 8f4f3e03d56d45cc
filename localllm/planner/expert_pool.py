"""The MoE expert cache's pool in a plan (issue #40, docs/expert-cache.md): what it costs,
which blocks it can serve, and whether the plan turns it on.

The engine (patches/0002-moe-expert-cache.patch) keeps `slots` experts, plus one slot of
zeros, of the first cacheable block's up/gate/down type and shape, in a pool on the model's
first GPU (or in RAM: the test setting expert_cache_device = cpu). It serves only the blocks
whose experts stay in RAM, in plain host buffers. So the plan reserves the pool's bytes out of
the first GPU's budget before the placement is searched, and keeps the pool only where the
placement it gets leaves experts in RAM.

A hit is priced (speed.ExpertPool): the share of the served blocks' routed experts found in
the pool is read by the GPU instead of the CPU, each served block pays a second chain of
kernels, and the experts copied in after each step cross PCIe. The share comes from a curve of
hit rate against slots per served block (a share of its experts): routing studies of real
models until this model's own hits were measured while serving (profiles/expert_hits.py),
then those. With `expert_cache = auto` the tuner prices a few pool sizes against none and keeps
the fastest: a pool whose hits do not pay for the dense weights its VRAM displaces is off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from localllm.modelstore.shape import EXPERTS, ModelShape

from .card import Card
from .memory import CPU
from .placements import placement_of_overrides
from .plan import DeviceMemory, Plan
from .search import NoPlanFits, Request
from . import ways
from .host_reads import decode_threads
from .speed import ExpertPool, curve_at
from .words import gib, seconds

# The three matrices of one expert the pool holds, as the GGUF names their stacks.
POOL_TENSORS = ("ffn_up_exps.weight", "ffn_gate_exps.weight", "ffn_down_exps.weight")
# each cached block's room for a short batch's routed experts, int32 per expert used per row,
# read back in one copy a step (patches/0004): the rows of a batch the pool serves
STEP_ID_ROWS = 31
AUTO_SLOTS = -1  # Request.expert_cache for `expert_cache = auto`: the tuner sizes it
# Hit rate against slots per served block as a share of its experts. Routing studies of real
# MoE models (256 experts, 8 a token) find an LRU of 64 hitting about 67% of lookups and 128
# about 81% (docs/synthetic-routing.md): 14 points a doubling, which the smaller shares
# extend (an LRU's curve is concave: linear from none, the 80B class's pool at a share of 0.18
# was priced at 49% and hit 61-64% on the H200, lab/runs/h200-2026-12-03-*). The
# engine's decayed counts, a few swaps a step, are not an LRU: hits measured while serving
# replace these.
PRIOR_HITS = ((0.0625, 0.39), (0.125, 0.53), (0.25, 0.67), (0.5, 0.81))
SWAPS_PER_STEP = 4  # the engine's default: the most experts a step copies in
# A bigger pool gets more swaps a step (one per SLOTS_PER_SWAP slots, SWAPS_PER_STEP at least),
# so that it warms in about as many steps as a small one. Replayed on the routing the 80B class
# reads in bench_session.py (scripts/bench/pool_replay.py; docs/synthetic-routing.md, "The
# policy, replayed"), 4322 slots over 46 blocks hit 61.8%, 68.3%, 73.2% in three answers with
# 4 a step and 63.2%, 73.1%, 76.7% with 8; a swap costs one expert's copy, about 0.7 of what
# the miss it saves costs (the GPU reads a miss from RAM at MAPPED_READ_FRACTION of PCIe).
# Pools of 1024-2048 slots gained nothing from more (Qwen3-30B-A3B: 62.1% / 68.0% with 4,
# 62.6% / 67.3% with 8) and keep 4.
SLOTS_PER_SWAP = 512
# Pool sizes `auto` prices: AUTO_SIZES slots per expert of one block (x n_expert), and the
# most slots that fit in each share of AUTO_VRAM_SHARES of the first GPU's budget, all within
# the largest share. 0.6 alone kept the 80B class's last two blocks' experts whole on a
# 12 GiB card beside 4322 slots over 46 blocks; at 0.7 its pool takes them too,
# 5043 slots over 48, and replayed on the benchmark's routing misses 163, 117, 96 experts a
# token in three answers where 4322 over 46 missed 169, 124, 107 (8 swaps a step each). 0.7
# alone lost Qwen3-30B-A3B's 1425 slots at 6 GiB (0.6's most) to 1024: each share is priced.
AUTO_SIZES = (2, 4, 8, 16, 32, 64)
AUTO_VRAM_SHARES = (0.5, 0.6, 0.7)
UNQUANTIZED = {"F32", "F16", "BF16"}
# How much faster than no pool `auto` must price a pool whose hit rate is assumed (the prior
# curve: this model not yet served with a pool here) to turn it on. The prior is an LRU's;
# the engine's policy on a model's own routing hits less (Qwen3-30B-A3B `--routing real` on
# an H100 at 12 GiB: 60.6% in the 8K band where 70% was assumed, 46% with `balanced`). It was
# 1.35 while experts in RAM were priced from a table that made no pool look 40-66% slower
# than it was (a pool priced 122 decoded 89 where no pool gave 116). Priced from the
# machine's kernels, the pool's lead came within 4% of the one served (lab/runs/
# h100-2026-12-07e-moe-measured.md; 8K band: priced 1.44x no pool, served 101.7 against
# 69.2, 1.47x; 32K band: 1.34x, served 63.3 against 49.2, 1.29x), where 1.35 had kept the
# 32K band on no pool for its first 16K prompt. What is left is the prior's optimism on a
# flat router; the ways are measured while serving either way (planner/ways.py). Measured
# hits need no margin.
ASSUMED_HITS_MARGIN = 1.15


@dataclass(frozen=True)
class PoolShape:
    """What the engine's pool is made of for one model."""

    slot_bytes: int  # one expert's up + gate + down bytes (the first cacheable block's)
    n_expert: int
    blocks: tuple[int, ...]  # blocks of that same type and shape: those the pool can serve
    n_expert_used: int
    # quantized experts: the GPU can compute the misses from RAM (its kernels that skip a row
    # are the quantized ones, patches/0003)
    quantized: bool = True

    @property
    def zero_slots(self) -> int:
        """Slots of zeros where misses point, one per routed position: no two of a token's
        experts may share a pool id (CUDA's batched MoE kernels take each expert once a
        token)."""
        return max(1, self.n_expert_used)

    def bytes(self, slots: int) -> int:
        """The pool of `slots` experts: the slots, the zero slots and the blocks' bookkeeping."""
        return (slots + self.zero_slots) * self.slot_bytes + self._bookkeeping()

    def slots_in(self, budget: int) -> int:
        """The most slots `budget` bytes hold (0: not even one)."""
        room = budget - self._bookkeeping()
        return max(0, room // self.slot_bytes - self.zero_slots) if self.slot_bytes else 0

    def _bookkeeping(self) -> int:
        """The blocks' maps and the room for a step's routed experts."""
        per_block = self.n_expert * (self.zero_slots + 1) * 4 + \
            self.zero_slots * STEP_ID_ROWS * 4
        return len(self.blocks) * per_block


def pool_shape(shape: ModelShape) -> PoolShape | None:
    """The pool the engine would build for this model; None for a model whose experts it
    cannot cache (a dense model; merged gate_up experts, biases or scales)."""
    if not shape.expert_count:
        return None
    nextn = {layer.index for layer in shape.layers if layer.is_nextn}
    by_block: dict[int, dict[str, tuple]] = {}
    for t in shape.tensors:
        if t.role == EXPERTS and t.layer is not None and t.layer not in nextn:
            suffix = t.name.split(".", 2)[2]
            by_block.setdefault(t.layer, {})[suffix] = (t.ggml_type, t.shape, t.n_bytes)
    first: dict[str, tuple] | None = None
    blocks = []
    for block in sorted(by_block):
        tensors = by_block[block]
        if set(tensors) != set(POOL_TENSORS):  # gate_up, biases, scales: not cached
            continue
        kinds = {name: tensors[name][:2] for name in POOL_TENSORS}
        if first is None:
            first = tensors
        elif kinds != {name: first[name][:2] for name in POOL_TENSORS}:
            continue
        blocks.append(block)
    if first is None:
        return None
    slot = sum(first[name][2] for name in POOL_TENSORS) // shape.expert_count
    quantized = all(first[name][0] not in UNQUANTIZED for name in POOL_TENSORS)
    return PoolShape(slot, shape.expert_count, tuple(blocks), shape.expert_used_count,
                     quantized)


def blocks_in_ram(plan: Plan, shape: ModelShape, pool: PoolShape) -> list[int]:
    """The pool's blocks whose experts the plan keeps in RAM: whole blocks on the CPU (the
    first n_layer + 1 - n_gpu_layers) and those its experts override names."""
    placement = placement_of_overrides(plan.n_gpu_layers, plan.tensor_overrides)
    on_cpu = 0 if plan.n_gpu_layers < 0 else max(0, shape.n_layer + 1 - plan.n_gpu_layers)
    return [b for b in pool.blocks if b < on_cpu or b < placement.n_cpu_expert_layers]


def _with_pool_memory(plan: Plan, device: str, pool_bytes: int) -> Plan:
    """The plan's memory with the pool counted in `device`'s weights."""
    memory = list(plan.memory)
    at = next((i for i, m in enumerate(memory) if m.device == device), None)
    if at is None:
        memory.append(DeviceMemory(device, weights=pool_bytes))
    else:
        memory[at] = replace(memory[at], weights=memory[at].weights + pool_bytes)
    return replace(plan, memory=tuple(memory))


def _off(plan: Plan, why: str) -> Plan:
    return replace(plan, expert_cache=0,
                   reasons=(*plan.reasons, f"expert cache off: {why}"))


def hit_curve(measured: tuple[tuple[float, float, float], ...] = ()
              ) -> tuple[tuple[float, float], ...]:
    """(share, hit rate) points, rising: the measured ones (share, hit rate, swaps a step),
    and the prior's elsewhere, scaled by how the nearest measurement compares with it."""
    if not measured:
        return PRIOR_HITS
    points = {round(share, 4): rate for share, rate, _ in measured}
    for share, rate in PRIOR_HITS:
        nearest = min(measured, key=lambda m: abs(m[0] - share))
        if abs(nearest[0] - share) > 0.05:
            scale = nearest[1] / max(curve_at(PRIOR_HITS, nearest[0]), 1e-6)
            points[share] = min(1.0, rate * scale)
    return tuple(sorted(points.items()))


def priced_pool(pool: PoolShape, slots: int, request: Request,
                misses_on_gpu: bool = False) -> ExpertPool:
    """The pool as decode prices it: its curve, and the bytes a step copies in (measured swaps
    a step where the hits were measured, else the most a step copies at the misses' share)."""
    curve = hit_curve(request.measured_hits)
    if request.measured_hits:
        swaps = max(m[2] for m in request.measured_hits)
    else:
        misses = 1.0 - curve_at(curve, slots / (len(pool.blocks) * pool.n_expert))
        swaps = swaps_per_step(slots) * misses
    return ExpertPool(slots, pool.n_expert, frozenset(pool.blocks), curve,
                      swap_bytes=swaps * pool.slot_bytes, misses_on_gpu=misses_on_gpu)


def swaps_per_step(slots: int) -> int:
    """The most experts a pool of `slots` takes in after a step (SLOTS_PER_SWAP)."""
    return max(SWAPS_PER_STEP, slots // SLOTS_PER_SWAP)


def misses_ways(pool: PoolShape, setting: str) -> tuple[bool, ...]:
    """Whether the misses go to the GPU, in the ways the tuner prices for `setting`
    (config expert_misses): both for auto, where the GPU can compute them (quantized experts)."""
    if setting == "cpu" or not pool.quantized:
        return (False,)
    return (True,) if setting == "gpu" else (False, True)


def misses_can_go_to_gpu(plan: Plan) -> bool:
    """Whether the GPU can read this plan's experts in RAM in place: pinned where the file
    maps them, or copied into the GPU's pinned host buffer (load_mode none). Past RAM the
    file's pages must stay pageable."""
    return not plan.streamed_bytes and (plan.pin_in_place or not plan.use_mmap)


def _faster(a: Plan, b: Plan, by: float = 1.0) -> bool:
    """Whether plan `a` serves the planned session faster than `b` (its decode where either
    has no session priced), by the factor `by` at least."""
    if a.predicted_session_s > 0 and b.predicted_session_s > 0:
        return a.predicted_session_s * by < b.predicted_session_s
    return a.predicted_decode_tps > b.predicted_decode_tps * by


def _sizes(pool: PoolShape, card: Card, request: Request) -> list[int]:
    """The pool sizes `auto` prices: AUTO_SIZES experts a block, and the most slots that fit
    in each of AUTO_VRAM_SHARES of the first GPU's budget. The largest matter for a model of
    many experts a block (512 on the 80B class), where 64 a block is under a tenth of them."""
    budget = card.gpu_list[0].free_vram_bytes - request.margin_bytes
    room = int(budget * max(AUTO_VRAM_SHARES))
    sizes = [k * pool.n_expert for k in AUTO_SIZES if pool.bytes(k * pool.n_expert) <= room]
    for share in AUTO_VRAM_SHARES:
        most = pool.slots_in(int(budget * share))
        if most >= AUTO_SIZES[0] * pool.n_expert and most not in sizes and \
                most < len(pool.blocks) * pool.n_expert:
            sizes.append(most)
    return sizes


def with_expert_pool(shape: ModelShape, card: Card, request: Request,
                     tune: Callable[[Request], Plan]) -> Plan:
    """The plan `tune` makes for `request` with its expert cache decided. N slots asked: on
    where the model's experts can be cached and the plan keeps some in RAM, their VRAM kept out
    of the first GPU's budget and their hits priced; off otherwise, and the reasons say why.
    AUTO_SLOTS: the fastest of a few priced pool sizes and none. `tune` plans one request (the
    tuner's search, called with no slots)."""
    slots = request.expert_cache
    auto = slots == AUTO_SLOTS
    plain = replace(request, expert_cache=0)
    asked = ("expert_cache = auto" if auto else f"expert_cache = {slots}") + \
        " applies to MoE models only"
    pool = pool_shape(shape)
    if pool is None:
        why = (f"{shape.name or 'this model'} is a dense model (no MoE experts): {asked}"
               if not shape.expert_count else
               "its experts are not separate up, gate and down matrices without biases or "
               "scales, the only layout the engine's pool holds")
        return _off(tune(plain), why)
    in_ram = request.expert_cache_device == "cpu"
    if not in_ram and not card.has_gpu:
        return _off(tune(plain), "no GPU to hold the pool (expert_cache_device = cpu puts it "
                                 "in RAM, for tests)")
    without = tune(plain)
    if not blocks_in_ram(without, shape, pool):
        return _off(without, "the plan keeps every expert on the GPU: no expert in RAM for "
                             "the pool to serve")
    if in_ram:  # a test knob: the CPU computes hits and misses alike, nothing to price
        if auto:
            return _off(without, "a pool in RAM (expert_cache_device = cpu) gains no speed: "
                                 "auto sizes a pool on a GPU only")
        in_ram_plan = replace(_with_pool_memory(without, CPU, pool.bytes(slots)),
                              expert_cache_device="cpu")
        return _on(in_ram_plan, shape, pool, slots,
                   f"in RAM ({gib(pool.bytes(slots))}, expert_cache_device = cpu)", None)
    device = card.gpu_list[0].device
    # Priced at the context the plan without a pool gets: a pool that only fits beside a
    # smaller context would win by a shallower session, not by its hits.
    same = replace(plain, n_ctx=without.n_ctx)
    best: dict[str, tuple[Plan, int, ExpertPool]] = {}  # each way's fastest pool
    for n in _sizes(pool, card, request) if auto else [slots]:
        for on_gpu in misses_ways(pool, request.expert_misses):
            priced = priced_pool(pool, n, request, on_gpu)
            try:
                plan = tune(replace(same, reserved_vram_bytes=pool.bytes(n), expert_pool=priced))
            except NoPlanFits:
                continue
            if on_gpu and not misses_can_go_to_gpu(plan):
                continue
            way = ways.pool_way(on_gpu)
            if blocks_in_ram(plan, shape, pool) and (way not in best or
                                                     _faster(plan, best[way][0])):
                best[way] = (plan, n, priced)
    if not best:
        smallest = AUTO_SIZES[0] * pool.n_expert if auto else slots
        what = f"no pool of {smallest} slots or more" if auto else f"its {slots} slots"
        return _off(without, f"{what} ({gib(pool.bytes(smallest))}) do not fit in VRAM "
                             "beside the smallest placement")
    fastest = next(iter(best))
    for other in best:
        if _faster(best[other][0], best[fastest][0]):
            fastest = other
    plan, n, priced = best[fastest]
    margin = 1.0 if request.measured_hits else ASSUMED_HITS_MARGIN
    declined = auto and not _faster(plan, without, margin)  # by price, no pool
    priced_ways = {w: b[0] for w, b in best.items()} | ({"no-pool": without} if auto else {})
    key = ways.situation(card, request.margin_bytes, without.n_ctx,
                         decode_threads(card, request.n_threads))
    way, measuring, table = ways.choose(priced_ways, "no-pool" if declined else fastest,
                                        request.measured_ways.get(key, {}))
    weighed = dict(way=way, ways=table, ways_key=key if table else "")
    if way == "no-pool":
        versus = _versus(plan, without, shape, pool, priced, bool(request.measured_hits))
        if declined:
            pays = "it does not pay" if not _faster(plan, without) else \
                f"it gains less than the {margin - 1:.0%} an assumed hit rate must win by"
            why = (f"the best pool priced, {n} slots, {versus}: {pays} for the weights its "
                   "VRAM moves to RAM")
        else:
            why = f"the best pool priced, {n} slots, {versus}; measurement decides (ways)"
        return _with_ways(replace(_off(without, why), **weighed), measuring)
    plan, n, priced = best[way]
    if request.n_ctx is None:  # the context was chosen for the plan without a pool: say why
        chosen = [r for r in without.reasons if r.startswith(f"context {without.n_ctx}")]
        plan = replace(plan, reasons=tuple(
            chosen[0] if chosen and r == f"context {plan.n_ctx}, as asked" else r
            for r in plan.reasons))
    versus = _versus(plan, without, shape, pool, priced, bool(request.measured_hits))
    where = f"on {device} ({gib(pool.bytes(n))} of VRAM kept out of the placement's budget)"
    plan = _with_pool_memory(plan, device, pool.bytes(n))
    plan = replace(plan, expected_hit_rate=round(
        priced.hit_rate(len(blocks_in_ram(plan, shape, pool))), 4),
        expert_misses_on_gpu=priced.misses_on_gpu, expert_cache_swaps=swaps_per_step(n))
    if priced.misses_on_gpu:
        where += ("; its misses read by the GPU where they lie in pinned RAM, over PCIe, so "
                  "a decode step never passes through the CPU")
    versus += "" if _faster(plan, without) else ": the pool does not pay here"
    return _with_ways(replace(_on(plan, shape, pool, n, where, versus), **weighed), measuring)


def _with_ways(plan: Plan, measuring: str) -> Plan:
    """The plan with a reason saying how the ways in doubt were decided (planner/ways.py)."""
    return replace(plan, reasons=(*plan.reasons, f"ways: {measuring}")) if measuring else plan


def _versus(plan: Plan, without: Plan, shape: ModelShape, pool: PoolShape,
            priced: ExpertPool, measured: bool) -> str:
    """The priced pool against no pool, in words: hit rate, decode, session."""
    cached = len(blocks_in_ram(plan, shape, pool))
    source = "from this model's hits measured while serving" if measured else \
        "assumed from routing studies of real models until measured"
    line = (f"expected hit rate {priced.hit_rate(cached):.0%} ({source}), "
            f"predicted decode {plan.predicted_decode_tps:.1f} tok/s against "
            f"{without.predicted_decode_tps:.1f} without")
    if plan.predicted_session_s > 0 and without.predicted_session_s > 0:
        line += (f", session {seconds(plan.predicted_session_s)} against "
                 f"{seconds(without.predicted_session_s)}")
    return line


def _on(plan: Plan, shape: ModelShape, pool: PoolShape, slots: int, where: str,
        versus: str | None) -> Plan:
    cached = blocks_in_ram(plan, shape, pool)
    span = f"block {cached[0]}" if len(cached) == 1 else \
        f"{len(cached)} blocks ({cached[0]}-{cached[-1]})"
    on = (f"expert cache on: {slots} expert slots of {pool.slot_bytes / 2**20:.1f} MiB "
          f"{where} for the experts of {span} in RAM, taking in up to "
          f"{plan.expert_cache_swaps} a step; llama.cpp's repacking of CPU "
          "weights is off, since the pool is filled with the experts' bytes as the file has them")
    reasons = (on, f"expert cache: {versus}") if versus else (on,)
    return replace(plan, expert_cache=slots, reasons=(*plan.reasons, *reasons))
