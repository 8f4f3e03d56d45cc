"""What a model costs, block by block: the numbers every placement the tuner prices needs,
computed once from a ModelShape (weights per block, their dense FFN and experts, KV elements per
cell, recurrent state, attention FLOPs, the lm-head and what stays on the CPU)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, wraps
from typing import TypeVar

from localllm.modelstore.shape import (
    EXPERTS, OUTPUT, OUTPUT_NORM, RECURRENT_LAYER, SLIDING, ModelShape,
)

# The dense FFN matrices of a block, as the FFN override names them (norms stay with the block).
FFN_TENSOR = re.compile(r"^blk\.\d+\.ffn_(up|gate|down)\.")


@dataclass(frozen=True)
class ModelCosts:
    """The per-block numbers every placement needs, computed once from a ModelShape."""

    n_blocks: int  # all blocks, NextN included (llama.cpp's n_layer)
    block_bytes: tuple[int, ...]  # weights loaded per block, experts excluded
    ffn_bytes: tuple[int, ...]  # the part of block_bytes in the dense FFN matrices (up/gate/down)
    expert_bytes: tuple[int, ...]
    block_params: tuple[int, ...]  # weights (elements) per block, experts counted as active
    kinds: tuple[str, ...]
    kv_k_elements: tuple[int, ...]  # per cell, 0 for blocks that hold no KV
    kv_v_elements: tuple[int, ...]
    state_bytes: tuple[int, ...]  # recurrent state per sequence
    attention_flops: tuple[int, ...]  # per cell of context read at decode (QK and softmax V)
    embedding_bytes: int
    output_bytes: int  # the lm-head, on the output layer's device unless overridden
    output_norm_bytes: int  # the final norm: always on the output layer's device
    output_params: int
    cpu_other_bytes: int  # tensors outside blocks that stay on the CPU (rope tables...)
    expert_active_fraction: float  # experts read per token / all experts
    sliding_window: int
    n_vocab: int
    n_embd: int
    n_head: int
    n_ff: int
    n_ff_active_experts: int  # expert FFN width times experts used per token
    n_expert_used: int = 0  # experts a token is routed to (0: a dense model)
    expert_types: tuple[tuple[str, float], ...] = ()  # the experts' ggml types, share of bytes

    # Hashed once: the search keys its caches (per_costs) by ModelCosts inside Speculators.
    def __hash__(self) -> int:
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash(tuple(getattr(self, name) for name in self.__dataclass_fields__))

    @cached_property
    def memo(self) -> dict:
        """Results of pure functions of these costs (per_costs), by function and arguments."""
        return {}

    @property
    def has_experts(self) -> bool:
        return any(self.expert_bytes)

    @cached_property  # asked for every block of every placement tried
    def n_trunk(self) -> int:
        """Blocks that hold weights (NextN blocks are skipped unless MTP is loaded)."""
        return sum(1 for b, e in zip(self.block_bytes, self.expert_bytes, strict=True) if b or e)

    @property
    def has_sliding(self) -> bool:
        return SLIDING in self.kinds and self.sliding_window > 0

    @cached_property  # asked for by every compute buffer priced
    def max_block_bytes(self) -> int:
        return max((b + e for b, e in zip(self.block_bytes, self.expert_bytes, strict=True)),
                   default=0)


R = TypeVar("R")
MEMO_LIMIT = 50_000  # results kept per function and ModelCosts before the cache starts over


def per_costs(fn: Callable[..., R]) -> Callable[..., R]:
    """Cache a pure function of a ModelCosts and hashable arguments on that ModelCosts: the
    search prices the same placement at the same settings many times (to see whether it fits,
    to price it, at each depth of a session, under each drafting mode), and the answer is the
    same object each time. Results must not be mutated."""
    @wraps(fn)
    def cached(costs: ModelCosts, *args, **kwargs) -> R:
        memo = costs.memo.setdefault(fn, {})
        key = (args, tuple(kwargs.items())) if kwargs else args
        try:
            return memo[key]
        except KeyError:
            pass
        if len(memo) >= MEMO_LIMIT:
            memo.clear()
        out = memo[key] = fn(costs, *args, **kwargs)
        return out

    return cached


def model_costs(shape: ModelShape, load_mtp: bool = False) -> ModelCosts:
    n = shape.n_layer
    block = [0] * n
    ffn = [0] * n
    experts = [0] * n
    expert_types: dict[str, int] = {}
    params = [0] * n
    active = (shape.expert_used_count / shape.expert_count) if shape.expert_count else 1.0
    output_bytes = output_params = output_norm = other = 0
    skipped = {layer.index for layer in shape.layers if layer.is_nextn and not load_mtp}
    for t in shape.tensors:
        if t.layer is not None and t.layer < n:
            if t.layer in skipped:
                continue
            if t.role == EXPERTS:
                experts[t.layer] += t.n_bytes
                expert_types[t.ggml_type] = expert_types.get(t.ggml_type, 0) + t.n_bytes
                params[t.layer] += int(t.n_elements * active)
            else:
                block[t.layer] += t.n_bytes
                params[t.layer] += t.n_elements
                if FFN_TENSOR.match(t.name):
                    ffn[t.layer] += t.n_bytes
        elif t.role == OUTPUT:
            output_bytes += t.n_bytes
            output_params += t.n_elements
        elif t.role == OUTPUT_NORM:
            output_norm += t.n_bytes
        elif t.name != "token_embd.weight":
            other += t.n_bytes
    if shape.tied_embeddings:  # the token table again, as the lm-head
        output_bytes += shape.embedding_bytes
        output_params += sum(t.n_elements for t in shape.tensors if t.name == "token_embd.weight")
    k_el, v_el, state, flops = [0] * n, [0] * n, [0] * n, [0] * n
    n_recurrent = sum(1 for layer in shape.layers if layer.kind == RECURRENT_LAYER)
    for layer in shape.layers:
        if layer.is_nextn:
            continue
        if layer.kind == RECURRENT_LAYER:
            state[layer.index] = shape.recurrent_state_bytes // max(1, n_recurrent)
        else:
            k_el[layer.index] = layer.n_head_kv * layer.head_dim_k
            v_el[layer.index] = layer.n_head_kv * layer.head_dim_v
            flops[layer.index] = 2 * shape.n_head * (layer.head_dim_k + layer.head_dim_v)
    return ModelCosts(
        n_blocks=n, block_bytes=tuple(block), ffn_bytes=tuple(ffn), expert_bytes=tuple(experts),
        block_params=tuple(params), kinds=tuple(layer.kind for layer in shape.layers),
        kv_k_elements=tuple(k_el), kv_v_elements=tuple(v_el), state_bytes=tuple(state),
        attention_flops=tuple(flops),
        embedding_bytes=shape.embedding_bytes, output_bytes=output_bytes,
        output_norm_bytes=output_norm, output_params=output_params, cpu_other_bytes=other,
        expert_active_fraction=active,
        sliding_window=shape.sliding_window, n_vocab=shape.n_vocab,
        n_embd=shape.embedding_length, n_head=shape.n_head,
        n_ff=shape.feed_forward_length,
        n_ff_active_experts=shape.expert_feed_forward_length * shape.expert_used_count,
        n_expert_used=shape.expert_used_count if any(experts) else 0,
        expert_types=tuple((name, round(n_bytes / max(1, sum(experts)), 4))
                           for name, n_bytes in sorted(expert_types.items())),
    )
