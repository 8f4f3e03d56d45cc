r"""Where the weights go: a `Placement`, and the kinds of placement the search tries.

A placement puts the last `n_gpu_layers` of llama.cpp's n_layer + 1 layers on the GPUs; a kind
of placement keeps part of those layers' weights in RAM through a tensor override (the lm-head,
the experts of the first blocks, the FFN of the last blocks). Each kind is one object that says
everything about itself: what it keeps in RAM (the memory and speed models read it through
`in_ram` and `head_in_ram`), the tensor override that tells llama.cpp and reads a plan's back,
the placements of its kind worth pricing (the search), and how the plan's reasons describe it.
The search iterates `KINDS`; a new kind is a field of `Placement` and an object in that tuple,
both here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from localllm.modelstore.shape import ModelShape

from .costs import ModelCosts, per_costs
from .plan import TensorOverride

CPU = "CPU"


@dataclass(frozen=True)
class Placement:
    """Where the weights go. Blocks are llama.cpp's: the last `n_gpu_layers` of n_layer + 1.
    The fields between n_gpu_layers and gpu_split are the kinds' (at most one set)."""

    n_gpu_layers: int
    output_on_cpu: bool = False  # lm-head kept on the CPU by a tensor override
    n_cpu_expert_layers: int = 0  # MoE: the experts of blocks 0..k-1 kept on the CPU
    n_cpu_ffn_layers: int = 0  # dense FFN matrices of the last N trunk blocks kept on the CPU
    # Several GPUs: layers per GPU in order, summing to n_gpu_layers (llama.cpp's tensor_split);
    # empty: split evenly (one GPU: all of them)
    gpu_split: tuple[int, ...] = ()



@dataclass
class InRam:
    """Per block: bytes of dense weights and of experts that the overrides keep in RAM although
    the block's layer is on a GPU, and whether any override names the block at all. Lists
    while the kinds fill them in, tuples once in_ram returns it (a cached answer)."""

    dense: list[int] | tuple[int, ...]
    experts: list[int] | tuple[int, ...]
    named: list[bool] | tuple[bool, ...]


class Trial(Protocol):
    """What a kind needs of the search at one setting (evaluator.SearchAt): whether a placement
    fits the GPUs, and its option priced."""

    def fits(self, placement: Placement) -> bool: ...

    def price(self, placement: Placement): ...


def largest(pred: Callable[[int], bool], lo: int, hi: int) -> int | None:
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


def smallest(pred: Callable[[int], bool], lo: int, hi: int) -> int | None:
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


def span(first: int, last: int) -> str:
    return f"block {first}" if first == last else f"blocks {first}-{last}"


def _blocks_pattern(blocks: str, tensors: str) -> str:
    r"""The override of some tensors of some blocks: `^blk\.(3|4|5)` then the tensors' names."""
    return rf"^blk\.({blocks})" + tensors


def _read_blocks(name: str, tensors: str, patterns: tuple[str, ...]) -> dict:
    """{name: how many blocks} where one of `patterns` is _blocks_pattern(..., tensors)."""
    head = r"^blk\.("
    for pattern in patterns:
        if pattern.startswith(head) and pattern.endswith(")" + tensors):
            blocks = pattern[len(head):-len(")" + tensors)]
            if re.fullmatch(r"[\d|]+", blocks):
                return {name: len(blocks.split("|"))}
    return {}


class Kind:
    """Whole blocks: no override. The other kinds change what they keep in RAM."""

    field = ""  # the Placement field that holds this kind's setting
    name = "whole blocks"

    def used(self, p: Placement) -> bool:
        return bool(self.field) and bool(getattr(p, self.field))

    # ---- memory and speed
    def in_ram(self, costs: ModelCosts, p: Placement, out: InRam) -> None:
        """Add what this kind keeps in RAM of the blocks on a GPU."""

    def head_in_ram(self, p: Placement) -> bool:
        return False

    # ---- llama.cpp
    def overrides(self, shape: ModelShape, p: Placement) -> tuple[TensorOverride, ...]:
        return ()

    def read(self, patterns: tuple[str, ...]) -> dict:
        """This kind's Placement field as its own override among `patterns` says (a plan's,
        a saved profile's): {} where none is."""
        return {}

    # ---- the search
    def candidates(self, search: Trial, costs: ModelCosts, whole: int | None,
                   ffn_split: bool) -> list:
        """The options of this kind worth pricing, given `whole`: the most whole blocks that
        fit (None: not even 0)."""
        return [search.price(Placement(whole or 0))]

    # ---- the plan's reasons
    def describe(self, p: Placement, n_blocks: int, n_gpu_blocks: int, head: str) -> str:
        """The placement in words (explain's describe_placement); `head` says where the
        lm-head is."""
        return self.blocks(n_blocks, n_gpu_blocks, head) + f" (n_gpu_layers={p.n_gpu_layers})"

    @staticmethod
    def blocks(n_blocks: int, n_gpu_blocks: int, head: str) -> str:
        return (f"all {n_blocks} blocks" if n_gpu_blocks >= n_blocks
                else f"{n_gpu_blocks} of {n_blocks} blocks") + f" on the GPU, {head}"

    def reasons(self, p: Placement) -> list[str]:
        """Lines the plan's reasons add when the winner is of this kind."""
        return []

    def short(self, p: Placement) -> str | None:
        """What it keeps in RAM in a few words, beside a micro-batch or a fill band (None:
        nothing of the blocks)."""
        return None

    def alternative(self, p: Placement) -> str:
        """How a rejected alternative of this kind is named after its KV setting."""
        return ", whole blocks"

    def closer(self, p: Placement, n_all: int) -> tuple[Placement, str] | None:
        """The next placement toward the GPU, and its words, which the plan says did not fit
        (None: none to show)."""
        if p.n_gpu_layers < n_all:
            return Placement(p.n_gpu_layers + 1), f"n_gpu_layers={p.n_gpu_layers + 1}"
        return None


class HeadInRam(Kind):
    """The lm-head kept in RAM: it frees room for blocks, and pays only when those blocks would
    otherwise be read from RAM too."""

    field = "output_on_cpu"
    name = "lm-head in RAM"

    def head_in_ram(self, p: Placement) -> bool:
        return p.output_on_cpu

    def overrides(self, shape: ModelShape, p: Placement) -> tuple[TensorOverride, ...]:
        if not p.output_on_cpu:
            return ()
        # With tied embeddings the lm-head is the token table loaded a second time.
        name = "token_embd" if shape.tied_embeddings else "output"
        return (TensorOverride(rf"^{name}\.weight$", CPU),)

    def read(self, patterns: tuple[str, ...]) -> dict:
        head = (r"^output\.weight$", r"^token_embd\.weight$")
        return {self.field: True} if any(p in head for p in patterns) else {}

    def candidates(self, search: Trial, costs: ModelCosts, whole: int | None,
                   ffn_split: bool) -> list:
        n_all = costs.n_blocks + 1
        if whole is None or whole >= n_all or not costs.output_bytes:
            return []
        n = largest(lambda n: search.fits(Placement(n, output_on_cpu=True)), 1, n_all)
        return [search.price(Placement(n, output_on_cpu=True))] if n is not None \
            and n > whole else []

    def alternative(self, p: Placement) -> str:
        return ", lm-head on the CPU"

    def closer(self, p: Placement, n_all: int) -> tuple[Placement, str] | None:
        if p.n_gpu_layers < n_all:
            return Placement(p.n_gpu_layers + 1, output_on_cpu=True), \
                f"n_gpu_layers={p.n_gpu_layers + 1}"
        return None


class ExpertsInRam(Kind):
    """MoE: attention and shared weights of every block on the GPU, the experts of the first
    blocks in RAM. Experts are most of such a model but few are read per token."""

    field = "n_cpu_expert_layers"
    name = "experts in RAM"

    def in_ram(self, costs: ModelCosts, p: Placement, out: InRam) -> None:
        for i in range(min(p.n_cpu_expert_layers, costs.n_blocks)):
            if costs.expert_bytes[i]:
                out.experts[i] += costs.expert_bytes[i]
                out.named[i] = True

    def overrides(self, shape: ModelShape, p: Placement) -> tuple[TensorOverride, ...]:
        if not p.n_cpu_expert_layers:
            return ()
        blocks = "|".join(str(i) for i in range(p.n_cpu_expert_layers))
        return (TensorOverride(_blocks_pattern(blocks, self.TENSORS), CPU),)

    TENSORS = r"\.ffn_(up|down|gate|gate_up)_exps\."

    def read(self, patterns: tuple[str, ...]) -> dict:
        return _read_blocks(self.field, self.TENSORS, patterns)

    def candidates(self, search: Trial, costs: ModelCosts, whole: int | None,
                   ffn_split: bool) -> list:
        n_all = costs.n_blocks + 1
        if not costs.has_experts or (whole is not None and whole >= n_all):
            return []
        k = smallest(lambda k: search.fits(Placement(n_all, n_cpu_expert_layers=k)),
                     0, costs.n_blocks)
        if k is not None:
            return [search.price(Placement(n_all, n_cpu_expert_layers=k))]
        n = largest(lambda n: search.fits(Placement(n, n_cpu_expert_layers=costs.n_blocks)),
                    0, n_all)
        return [search.price(Placement(n, n_cpu_expert_layers=costs.n_blocks))] if n else []

    def describe(self, p: Placement, n_blocks: int, n_gpu_blocks: int, head: str) -> str:
        k = min(p.n_cpu_expert_layers, n_blocks)
        return self.blocks(n_blocks, n_gpu_blocks, head) + \
            f"; the experts of blocks 0-{k - 1} in RAM (n_gpu_layers={p.n_gpu_layers})"

    def short(self, p: Placement) -> str:
        return f"experts of {p.n_cpu_expert_layers} blocks in RAM"

    def alternative(self, p: Placement) -> str:
        return f", experts of {p.n_cpu_expert_layers} blocks in RAM"

    def closer(self, p: Placement, n_all: int) -> tuple[Placement, str] | None:
        k = p.n_cpu_expert_layers - 1
        return Placement(p.n_gpu_layers, n_cpu_expert_layers=k), f"experts of {k} blocks in RAM"


MIX_POINTS = 10  # whole-block counts tried under the attention-on-GPU placement


class FfnInRam(Kind):
    """Dense models: every block's attention and KV on the GPU, the FFN matrices of the fewest
    last blocks in RAM (llama.cpp's `-ot "blk\\.(...)\\.ffn_(up|gate|down)\\.=CPU"`), mixed with
    whole blocks in RAM where the KV of every block does not fit."""

    field = "n_cpu_ffn_layers"
    name = "FFN in RAM"

    def in_ram(self, costs: ModelCosts, p: Placement, out: InRam) -> None:
        k = p.n_cpu_ffn_layers
        if not k:
            return
        for i in range(max(0, costs.n_trunk - k), costs.n_trunk):
            out.dense[i] += costs.ffn_bytes[i]
            out.named[i] = True

    def overrides(self, shape: ModelShape, p: Placement) -> tuple[TensorOverride, ...]:
        if not p.n_cpu_ffn_layers:
            return ()
        n_trunk = shape.n_layer_main
        first = max(0, n_trunk - p.n_cpu_ffn_layers)
        blocks = "|".join(str(i) for i in range(first, n_trunk))
        return (TensorOverride(_blocks_pattern(blocks, self.TENSORS), CPU),)

    TENSORS = r"\.ffn_(up|gate|down)\."

    def read(self, patterns: tuple[str, ...]) -> dict:
        return _read_blocks(self.field, self.TENSORS, patterns)

    def candidates(self, search: Trial, costs: ModelCosts, whole: int | None,
                   ffn_split: bool) -> list:
        """The whole-block counts are sampled, then the best is refined with its neighbours."""
        n_all, n_trunk = costs.n_blocks + 1, costs.n_trunk
        if costs.has_experts or not any(costs.ffn_bytes) or not ffn_split \
                or (whole is not None and whole >= n_all):
            return []
        tried: dict = {}

        def at(n: int):
            if n not in tried:
                k = smallest(lambda k: search.fits(Placement(n, n_cpu_ffn_layers=k)), 0, n_trunk)
                tried[n] = search.price(Placement(n, n_cpu_ffn_layers=k)) if k else None
            return tried[n]

        lo = (whole or 0) + 1
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

    def describe(self, p: Placement, n_blocks: int, n_gpu_blocks: int, head: str) -> str:
        ffn_first = max(n_blocks - p.n_cpu_ffn_layers, n_blocks - n_gpu_blocks)
        whole = n_blocks - n_gpu_blocks
        text = ("every block's attention and KV on the GPU" if not whole else
                f"{span(0, whole - 1)} whole in RAM, the attention and KV of the other "
                f"{n_gpu_blocks} on the GPU")
        return text + (f", the FFN of {span(ffn_first, n_blocks - 1)} in RAM, {head} "
                       f"(n_gpu_layers={p.n_gpu_layers}, FFN override)")

    def reasons(self, p: Placement) -> list[str]:
        return ["attention stays where its KV is: with every block's attention on the GPU, "
                "decode keeps its speed as the context fills, where whole blocks in RAM would "
                "attend over their KV on the CPU"]

    def short(self, p: Placement) -> str:
        return f"FFN of {p.n_cpu_ffn_layers} blocks in RAM"

    def alternative(self, p: Placement) -> str:
        return ", attention on the GPU and FFN in RAM"

    def closer(self, p: Placement, n_all: int) -> tuple[Placement, str] | None:
        return None


WHOLE = Kind()
# The kinds the search tries, in the order it tries them (whole blocks first: the others start
# from the most whole blocks that fit).
KINDS: tuple[Kind, ...] = (WHOLE, HeadInRam(), ExpertsInRam(), FfnInRam())


def kind_of(p: Placement) -> Kind:
    """The placement's kind: the first whose field it sets, else whole blocks."""
    return next((k for k in KINDS[1:] if k.used(p)), WHOLE)


@per_costs
def in_ram(costs: ModelCosts, p: Placement) -> InRam:
    n = costs.n_blocks
    out = InRam([0] * n, [0] * n, [False] * n)
    for kind in KINDS:
        if kind.used(p):
            kind.in_ram(costs, p, out)
    return InRam(tuple(out.dense), tuple(out.experts), tuple(out.named))


def head_in_ram(p: Placement) -> bool:
    return any(kind.head_in_ram(p) for kind in KINDS)


def overridden(p: Placement) -> bool:
    """Whether any kind keeps weights in RAM by an override."""
    return any(kind.used(p) for kind in KINDS)


def placement_of_overrides(n_gpu_layers: int, overrides: tuple[TensorOverride, ...],
                           gpu_split: tuple[int, ...] = ()) -> Placement:
    """The placement that a plan's n_gpu_layers, tensor overrides and local split describe: each
    kind reads its own override back."""
    patterns = tuple(o.pattern for o in overrides)
    found = {k: v for kind in KINDS for k, v in kind.read(patterns).items()}
    return Placement(n_gpu_layers, gpu_split=gpu_split, **found)


def tensor_overrides(shape: ModelShape, p: Placement) -> tuple[TensorOverride, ...]:
    """llama.cpp's tensor overrides (-ot) that put the placement's kind in place."""
    return tuple(o for kind in KINDS for o in kind.overrides(shape, p))
