"""What a card leaves a plan: VRAM per GPU after the user's margin, the ways layers may be laid
over several GPUs, and the host RAM a plan may use."""

from __future__ import annotations

from dataclasses import dataclass
from .card import GIB, Card
from .search import Request

# Of the RAM available at load, kept for the runner's own memory (the Python process, CUDA's
# pinned staging buffers, allocator slack) rather than planned for weights, KV and buffers.
RAM_RESERVE = 1 * GIB


def vram_budget(card: Card, margin: int, reserved: int = 0) -> int:
    """Per GPU: free memory less the user's margin (the CUDA overhead is counted per device);
    several GPUs: the smallest of theirs."""
    return min(vram_budgets(card, margin, reserved).values(), default=0)


def vram_budgets(card: Card, margin: int, reserved: int = 0) -> dict[str, int]:
    """Each GPU's free memory less the user's margin, and the first GPU's less `reserved`
    (the expert cache's pool, which the engine puts on the model's first GPU)."""
    return {g.device: max(0, g.free_vram_bytes - margin - (reserved if i == 0 else 0))
            for i, g in enumerate(card.gpu_list)}


@dataclass(frozen=True)
class Layout:
    """Which GPUs take layers, and the shares the split follows: by free memory (as llama.cpp
    splits when told nothing), or the fastest GPU filled first."""

    name: str
    shares: tuple[float, ...]


def gpu_layouts(card: Card, budgets: dict[str, int]) -> tuple[Layout, ...]:
    """The layouts worth pricing on several GPUs: every set of them (alike GPUs counted once),
    each split by free memory, and fastest first where their speeds differ. Leaving a GPU out
    pays where the model fits the others and the slow card would only slow it down."""
    gpus = card.gpu_list
    out, seen = [], set()
    for mask in sorted(range(1, 1 << len(gpus)), key=lambda m: (-bin(m).count("1"), m)):
        chosen = [g for i, g in enumerate(gpus) if mask >> i & 1]
        kinds = tuple(sorted((g.free_vram_bytes, g.bandwidth_gbs, g.fp16_tflops) for g in chosen))
        if kinds in seen:
            continue
        seen.add(kinds)
        names = "+".join(g.device for g in chosen)
        out.append(Layout(f"{names} by free memory", tuple(
            float(budgets[g.device]) if mask >> i & 1 else 0.0 for i, g in enumerate(gpus))))
        fastest = max(g.bandwidth_gbs for g in chosen)
        if any(g.bandwidth_gbs != fastest for g in chosen):
            out.append(Layout(f"{names} fastest first", tuple(
                (1e6 if g.bandwidth_gbs == fastest else 1.0) if mask >> i & 1 else 0.0
                for i, g in enumerate(gpus))))
    return tuple(out)


def ram_budget(card: Card, request: Request | None = None) -> int:
    """Host RAM the plan may use: the config's ram_budget where set; else what was available
    when the card was probed (MemAvailable capped by the cgroup) less a reserve for the
    runner itself; for a card that was not probed, the physical RAM less 10% (at least 2 GiB)
    that the system keeps."""
    if request is not None and request.ram_budget_bytes:
        return request.ram_budget_bytes
    if card.ram_available_bytes:
        return max(0, card.ram_available_bytes - RAM_RESERVE)
    return max(0, card.ram_bytes - max(2 * GIB, card.ram_bytes // 10))
