"""ModelShape: what a model costs to run, read from its GGUF header alone.

Everything here is derived from metadata keys and tensor names, generic over architectures:
per-tensor bytes grouped by layer and role, KV heads and head sizes per layer, which layers are
sliding-window or recurrent, NextN/MTP layers, trained context, tied embeddings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from .gguf_header import GGUFHeader, TensorEntry, read_header

# Tensor roles, as the tuner places them.
EMBEDDING, OUTPUT, OUTPUT_NORM, ATTENTION, FFN, EXPERTS, NORM, RECURRENT, OTHER = (
    "embedding", "output", "output_norm", "attention", "ffn", "experts", "norm", "recurrent",
    "other",
)
FULL, SLIDING, RECURRENT_LAYER = "full", "sliding", "recurrent"

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Tensor:
    name: str
    ggml_type: str  # "Q4_K", "F16", ...
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    layer: int | None  # block index, None for embeddings/output
    role: str


@dataclass(frozen=True)
class Layer:
    index: int
    kind: str  # FULL, SLIDING or RECURRENT_LAYER
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    is_nextn: bool
    weight_bytes: int
    expert_bytes: int  # part of weight_bytes held by MoE expert tensors
    shared_expert_bytes: int = 0  # part of weight_bytes held by the shared expert (*_shexp)


@dataclass(frozen=True)
class ModelShape:
    path: str
    file_size: int
    architecture: str
    name: str
    file_type: str  # "Q4_K_M", "Q4_1", ... ("unknown" when the header does not say)
    n_params: int
    n_layer: int  # blocks, including NextN blocks
    n_nextn: int  # trailing NextN/MTP blocks (0 for most models)
    context_length: int  # trained context
    embedding_length: int
    n_head: int
    n_vocab: int
    sliding_window: int  # 0 when the model has no sliding-window layers
    tied_embeddings: bool
    expert_count: int
    expert_used_count: int
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    recurrent_state_bytes: int  # per sequence, summed over recurrent layers (f32 state)
    layers: tuple[Layer, ...]
    tensors: tuple[Tensor, ...] = field(repr=False)
    feed_forward_length: int = 0  # largest dense FFN width over the layers
    expert_feed_forward_length: int = 0  # per expert, MoE models
    expert_shared_feed_forward_length: int = 0  # the shared expert's width (0: none)

    @property
    def n_layer_main(self) -> int:
        """Blocks of the trunk, without the NextN/MTP blocks."""
        return self.n_layer - self.n_nextn

    @property
    def embedding_bytes(self) -> int:
        """The input token table (always on the CPU in llama.cpp)."""
        return sum(t.n_bytes for t in self.tensors if t.name == "token_embd.weight")

    @property
    def output_bytes(self) -> int:
        """The lm-head: output.weight, or with tied embeddings the token table's copy, which
        llama.cpp loads a second time on the output layer's device."""
        out = sum(t.n_bytes for t in self.tensors if t.role == OUTPUT)
        return out if out else self.embedding_bytes

    @property
    def weight_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    @property
    def size_label(self) -> str:
        return format_param_count(self.n_params)

    def role_bytes(self, role: str) -> int:
        return sum(t.n_bytes for t in self.tensors if t.role == role)

    def kv_bytes_per_token(self, bytes_per_element_k: float, bytes_per_element_v: float) -> float:
        """KV bytes one token of context costs over all full-attention layers."""
        return sum(
            layer.n_head_kv * (layer.head_dim_k * bytes_per_element_k
                               + layer.head_dim_v * bytes_per_element_v)
            for layer in self.layers if layer.kind == FULL and not layer.is_nextn
        )


def format_param_count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f}{unit}" if value < 10 else f"{value:.0f}{unit}"
    return str(n)


def read_shape(path: str | Path) -> ModelShape:
    return shape_from_header(read_header(path), str(path))


def shape_from_header(header: GGUFHeader, path: str) -> ModelShape:
    md = header.metadata
    arch = str(md.get("general.architecture", "unknown"))

    def key(name: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{name}", default)

    n_layer = int(key("block_count", 0))
    n_nextn = int(key("nextn_predict_layers", 0) or 0)
    n_embd = int(key("embedding_length", 0))
    n_head = _per_layer(key("attention.head_count", 0), n_layer)
    n_head_kv = _per_layer(key("attention.head_count_kv", key("attention.head_count", 0)), n_layer)
    head_dim_default = n_embd // max(1, n_head[0]) if n_head and n_head[0] else 0
    head_k = int(key("attention.key_length", head_dim_default) or head_dim_default)
    head_v = int(key("attention.value_length", head_dim_default) or head_dim_default)
    window = int(key("attention.sliding_window", 0) or 0)
    kinds = _layer_kinds(arch, md, key, n_layer, window)
    # NextN/MTP blocks are dense attention blocks whatever the trunk's pattern (llama.cpp marks
    # them neither recurrent nor sliding), and they hold no state in the main context.
    for i in range(max(0, n_layer - n_nextn), n_layer):
        kinds[i] = FULL

    tensors = tuple(_classify(t) for t in header.tensors)
    per_layer_bytes = [0] * n_layer
    per_layer_experts = [0] * n_layer
    per_layer_shared = [0] * n_layer
    for t in tensors:
        if t.layer is not None and t.layer < n_layer:
            per_layer_bytes[t.layer] += t.n_bytes
            if t.role == EXPERTS:
                per_layer_experts[t.layer] += t.n_bytes
            elif "_shexp" in t.name:
                per_layer_shared[t.layer] += t.n_bytes
    layers = tuple(
        Layer(
            index=i,
            kind=kinds[i],
            n_head_kv=n_head_kv[i] if kinds[i] != RECURRENT_LAYER else 0,
            head_dim_k=head_k,
            head_dim_v=head_v,
            is_nextn=i >= n_layer - n_nextn,
            weight_bytes=per_layer_bytes[i],
            expert_bytes=per_layer_experts[i],
            shared_expert_bytes=per_layer_shared[i],
        )
        for i in range(n_layer)
    )
    names = {t.name for t in tensors}
    vocab = md.get("tokenizer.ggml.tokens")
    n_vocab = int(key("vocab_size", 0) or header.array_lengths.get("tokenizer.ggml.tokens", 0)
                  or (len(vocab) if vocab else 0))
    template = md.get("tokenizer.chat_template")
    return ModelShape(
        path=path,
        file_size=header.file_size,
        architecture=arch,
        name=str(md.get("general.name", Path(path).stem)),
        file_type=_file_type_name(md.get("general.file_type")),
        n_params=sum(t.n_elements for t in tensors),
        n_layer=n_layer,
        n_nextn=n_nextn,
        context_length=int(key("context_length", 0) or 0),
        embedding_length=n_embd,
        n_head=n_head[0] if n_head else 0,
        n_vocab=n_vocab,
        sliding_window=window if SLIDING in kinds else 0,
        tied_embeddings="output.weight" not in names,
        expert_count=int(key("expert_count", 0) or 0),
        expert_used_count=int(key("expert_used_count", 0) or 0),
        chat_template=template if isinstance(template, str) and template.strip() else None,
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
        recurrent_state_bytes=_recurrent_state_bytes(key, kinds),
        layers=layers,
        tensors=tensors,
        feed_forward_length=max(_per_layer(key("feed_forward_length", 0), n_layer) or [0]),
        expert_feed_forward_length=int(key("expert_feed_forward_length", 0) or 0),
        expert_shared_feed_forward_length=int(key("expert_shared_feed_forward_length", 0) or 0),
    )


def _per_layer(value: Any, n_layer: int) -> list[int]:
    """Head counts are a scalar or (hybrid models) an array with one entry per layer."""
    if isinstance(value, list):
        return [int(v) for v in value] + [int(value[-1]) if value else 0] * (n_layer - len(value))
    return [int(value or 0)] * max(n_layer, 1)


def _layer_kinds(arch: str, md: dict, key, n_layer: int, window: int) -> list[str]:
    """Full, sliding-window or recurrent, per layer, as llama.cpp decides it for the arch."""
    pattern = key("attention.sliding_window_pattern")
    if isinstance(pattern, list) and pattern:  # explicit per-layer booleans
        return [SLIDING if pattern[i % len(pattern)] else FULL for i in range(n_layer)]
    recurrent = key("attention.recurrent_layers")
    if isinstance(recurrent, list) and recurrent:  # hybrid models' layer_types, one per block
        return [RECURRENT_LAYER if i < len(recurrent) and recurrent[i] else FULL
                for i in range(n_layer)]
    interval = key("full_attention_interval")
    if interval:  # hybrid recurrent models (qwen35, qwen3next): every Nth layer attends
        n = int(interval)
        return [FULL if (i + 1) % n == 0 else RECURRENT_LAYER for i in range(n_layer)]
    if key("ssm.state_size") and not key("attention.head_count_kv"):
        return [RECURRENT_LAYER] * n_layer  # pure state-space models
    if window:
        # llama.cpp's swa patterns: gemma3/cohere2 keep every 6th/4th layer global, gemma2 and
        # gpt-oss alternate; pattern N means layer i is sliding when i % N < N - 1.
        period = {"gemma3": 6, "gemma3n": 5, "cohere2": 4, "gemma2": 2, "gpt-oss": 2}.get(arch, 0)
        if isinstance(pattern, int) and pattern > 0:
            period = pattern
        if period:
            return [SLIDING if i % period < period - 1 else FULL for i in range(n_layer)]
    return [FULL] * n_layer


def _recurrent_state_bytes(key, kinds: list[str]) -> int:
    n_recurrent = kinds.count(RECURRENT_LAYER)
    if not n_recurrent:
        return 0
    d_conv = int(key("ssm.conv_kernel", 0) or 0)
    d_inner = int(key("ssm.inner_size", 0) or 0)
    d_state = int(key("ssm.state_size", 0) or 0)
    n_group = int(key("ssm.group_count", 0) or 0)
    per_layer = ((max(d_conv - 1, 0)) * (d_inner + 2 * n_group * d_state) + d_state * d_inner) * 4
    return per_layer * n_recurrent


def _classify(entry: TensorEntry) -> Tensor:
    m = _LAYER_RE.match(entry.name)
    layer = int(m.group(1)) if m else None
    suffix = m.group(2) if m else entry.name
    if layer is None:
        if entry.name.startswith("token_embd") or entry.name.startswith("per_layer_token_embd"):
            role = EMBEDDING
        elif entry.name == "output.weight":
            role = OUTPUT
        elif entry.name.startswith("output_norm"):
            role = OUTPUT_NORM
        else:
            role = OTHER
    elif "_exps" in suffix:
        role = EXPERTS
    elif suffix.startswith(("attn_", "attn.")) and "norm" not in suffix:
        role = ATTENTION
    elif suffix.startswith("ffn_") and "norm" not in suffix:
        role = FFN
    elif suffix.startswith("ssm_"):
        role = RECURRENT
    elif "norm" in suffix:
        role = NORM
    else:
        role = OTHER
    return Tensor(
        name=entry.name,
        ggml_type=entry.ggml_type.name,
        shape=entry.shape,
        n_elements=entry.n_elements,
        n_bytes=entry.n_bytes,
        layer=layer,
        role=role,
    )


def _file_type_name(value: Any) -> str:
    try:
        name = LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return "unknown"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")
