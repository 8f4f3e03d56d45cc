"""The MoE expert cache's pool in a plan (issue #40, docs/expert-cache.md): what it costs,
which blocks it can serve, and whether the plan turns it on.

The engine (patches/0002-moe-expert-cache.patch) keeps `slots` experts, plus one slot of
zeros, of the first cacheable block's up/gate/down type and shape, in a pool on the model's
first GPU (or in RAM: the test knob LLAMA_MOE_CACHE_DEVICE=cpu). It serves only the blocks
whose experts stay in RAM, in plain host buffers. So the plan reserves the pool's bytes out of
the first GPU's budget before the placement is searched, and keeps the pool only where the
placement it gets leaves experts in RAM. A hit is not priced yet: the plan's speeds are
those without the cache, and its reasons say so.
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
from .words import gib

# The three matrices of one expert the pool holds, as the GGUF names their stacks.
POOL_TENSORS = ("ffn_up_exps.weight", "ffn_gate_exps.weight", "ffn_down_exps.weight")
MAP_BYTES_PER_EXPERT = 8  # each cached block's map: (slot or miss id, expert), two int32
UNPRICED = ("expert cache: experimental, its speed is not priced yet (the predicted decode "
            "is without it) and it has been measured on the CPU backend only")


@dataclass(frozen=True)
class PoolShape:
    """What the engine's pool is made of for one model."""

    slot_bytes: int  # one expert's up + gate + down bytes (the first cacheable block's)
    n_expert: int
    blocks: tuple[int, ...]  # blocks of that same type and shape: those the pool can serve

    def bytes(self, slots: int) -> int:
        """The pool of `slots` experts: the slots, the zero slot and the blocks' maps."""
        return (slots + 1) * self.slot_bytes + \
            len(self.blocks) * self.n_expert * MAP_BYTES_PER_EXPERT

    def slots_in(self, budget: int) -> int:
        """The most slots `budget` bytes hold (0: not even one), for a tuner that sizes the
        pool from what a placement leaves (the next step of issue #40)."""
        room = budget - len(self.blocks) * self.n_expert * MAP_BYTES_PER_EXPERT
        return max(0, room // self.slot_bytes - 1) if self.slot_bytes else 0


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
    return PoolShape(slot, shape.expert_count, tuple(blocks))


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
    return replace(plan, expert_cache_slots=0,
                   reasons=(*plan.reasons, f"expert cache off: {why}"))


def with_expert_pool(shape: ModelShape, card: Card, request: Request,
                     tune: Callable[[Request], Plan]) -> Plan:
    """The plan `tune` makes for `request` with its expert cache decided: on with
    request.expert_cache_slots slots where the model's experts can be cached and the plan
    keeps some in RAM, their VRAM kept out of the first GPU's budget; off otherwise, and the
    reasons say why. `tune` plans one request (the tuner's search, called with no slots)."""
    slots = request.expert_cache_slots
    plain = replace(request, expert_cache_slots=0)
    asked = f"expert_cache = {slots} applies to MoE models only"
    pool = pool_shape(shape)
    if pool is None:
        why = (f"{shape.name or 'this model'} is a dense model (no MoE experts): {asked}"
               if not shape.expert_count else
               "its experts are not separate up, gate and down matrices without biases or "
               "scales, the only layout the engine's pool holds")
        return _off(tune(plain), why)
    in_ram = request.expert_pool_in_ram
    if not in_ram and not card.has_gpu:
        return _off(tune(plain), "no GPU to hold the pool (LLAMA_MOE_CACHE_DEVICE=cpu puts it "
                                 "in RAM, for tests)")
    need = pool.bytes(slots)
    device = CPU if in_ram else card.gpu_list[0].device
    try:
        plan = tune(plain if in_ram else replace(plain, reserved_vram_bytes=need))
    except NoPlanFits:
        plan = None
    cached = blocks_in_ram(plan, shape, pool) if plan is not None else []
    if not cached:
        whole = tune(plain)
        if not blocks_in_ram(whole, shape, pool):
            return _off(whole, "the plan keeps every expert on the GPU: no expert in RAM for "
                               "the pool to serve")
        return _off(whole, f"its {slots} slots ({gib(need)}) do not fit in VRAM beside the "
                           "smallest placement")
    where = (f"in RAM ({gib(need)}, LLAMA_MOE_CACHE_DEVICE=cpu)" if in_ram else
             f"on {device} ({gib(need)} of VRAM kept out of the placement's budget)")
    span = f"block {cached[0]}" if len(cached) == 1 else \
        f"{len(cached)} blocks ({cached[0]}-{cached[-1]})"
    on = (f"expert cache on: {slots} expert slots of {pool.slot_bytes / 2**20:.1f} MiB "
          f"{where} for the experts of {span} in RAM; llama.cpp's repacking of CPU weights "
          "is off, since the pool is filled with the experts' bytes as the file has them")
    plan = _with_pool_memory(plan, device, need)
    return replace(plan, expert_cache_slots=slots, reasons=(*plan.reasons, on, UNPRICED))
