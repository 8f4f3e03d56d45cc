"""A vision model's projector (mmproj) in the plan: its weights and compute buffer take room on
the card before the language model is planned, or it runs on the CPU when that room would
cost the language model layers; either way the plan says where and what one image costs.

Pure: the projector's header facts (modelstore.projector.ProjectorInfo), the card and a
planning function come in; a Plan comes out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from .card import Card
from .plan import DeviceMemory, Plan

MIB = 1 << 20
# What a CPU core and a GPU reach on a ViT's matrix products, FLOP/s (f16 weights): measured
# orders of magnitude, only for the per-image figure the plan shows.
CPU_FLOPS_PER_CORE = 40e9
GPU_FLOPS_FRACTION = 0.35  # of the card's fp16 peak


@dataclass(frozen=True)
class ProjectorCost:
    weights: int  # bytes
    compute: int  # bytes of the encoder's compute buffer for one image
    flops: float  # per image

    @property
    def total(self) -> int:
        return self.weights + self.compute


def projector_cost(info, flash_attn: bool = True) -> ProjectorCost:
    """Weights from the header; the compute buffer and FLOPs of one image through the encoder
    (patches x width activations, attention scores unless flash attention streams them)."""
    patches = (info.image_size // max(1, info.patch_size)) ** 2 or 1024
    width = info.n_embd or 1024
    ff = 4 * width
    per_layer = 2 * patches * (4 * width * width + 2 * width * ff) + 4 * patches * patches * width
    flops = float(per_layer * max(1, info.n_layer))
    activations = patches * max(ff, 3 * width) * 4 * 3
    scores = 0 if flash_attn else patches * patches * 4 * 16
    return ProjectorCost(info.weight_bytes, activations + scores + 32 * MIB, flops)


def image_seconds(cost: ProjectorCost, card: Card, on_gpu: bool) -> float:
    if on_gpu and card.has_gpu:
        return cost.flops / max(1e9, card.fp16_tflops * 1e12 * GPU_FLOPS_FRACTION)
    return cost.flops / (CPU_FLOPS_PER_CORE * max(1, card.cores))


def with_room_for_images(plan: Plan, image_tokens: int) -> Plan:
    """A projector that attends across a whole image (Gemma 3's) needs the image's tokens in
    one micro-batch: n_ubatch (and n_batch) raised to `image_tokens` where short."""
    if image_tokens <= plan.n_ubatch:
        return plan
    return replace(plan, n_ubatch=image_tokens, n_batch=max(plan.n_batch, image_tokens),
                   reasons=plan.reasons + (f"micro-batch raised to {image_tokens}: one image's "
                                           f"tokens are read in one",))


def plan_with_projector(card: Card, cost: ProjectorCost,
                        plan_for: Callable[[Card], Plan]) -> Plan:
    """The language model planned on the card less the projector's room (projector on the GPU),
    unless that costs it GPU layers the whole card would give it: then the projector runs on
    the CPU. `plan_for(card)` is the tuner."""
    if not card.has_gpu:
        return _placed(plan_for(card), cost, card, on_gpu=False, why="no GPU")
    room = card.free_vram_bytes - cost.total
    if room > 0:
        with_room = plan_for(card.less_vram(cost.total))
        whole = plan_for(card)
        if with_room.n_gpu_layers >= whole.n_gpu_layers:
            return _placed(with_room, cost, card, on_gpu=True,
                           why=f"{cost.total / MIB:.0f} MiB of the card kept for it")
        return _placed(whole, cost, card, on_gpu=False,
                       why=f"its {cost.total / MIB:.0f} MiB on the GPU would push "
                           f"{whole.n_gpu_layers - with_room.n_gpu_layers} layers to the CPU")
    return _placed(plan_for(card), cost, card, on_gpu=False,
                   why=f"its {cost.total / MIB:.0f} MiB do not fit the card")


def _placed(plan: Plan, cost: ProjectorCost, card: Card, on_gpu: bool, why: str) -> Plan:
    on_gpu = on_gpu and plan.n_gpu_layers > 0
    seconds = image_seconds(cost, card, on_gpu)
    memory = list(plan.memory)
    at = next((i for i, m in enumerate(memory) if (m.device != "CPU") == on_gpu), None)
    if at is None:
        memory.append(DeviceMemory("CUDA0" if on_gpu else "CPU"))
        at = len(memory) - 1
    memory[at] = replace(memory[at], weights=memory[at].weights + cost.weights,
                         compute=memory[at].compute + cost.compute)
    where = "GPU" if on_gpu else "CPU"
    return replace(plan, projector_on_gpu=on_gpu, predicted_image_s=seconds,
                   memory=tuple(memory),
                   reasons=(*plan.reasons, f"vision projector on the {where} ({why}); about "
                                           f"{seconds:.2f}s per image"))
