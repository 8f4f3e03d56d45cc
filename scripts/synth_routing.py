"""Router weights for synthetic MoE models: uniform, or skewed like a trained model's.

A block's router scores expert e as w_e . x, x the block's normed hidden state, and picks the
top k. With every w_e drawn at random the experts are chosen about uniformly, which no cache
can serve and real models never do. (Before this module, the `random` fill tiled 16 random
rows over every matrix, routers included: experts 16 apart scored alike and the choice was
skewed by accident, by an amount nobody chose. Routers are now always written in full.)

Skewed routing (`zipf:S`): one direction u is added to every token's embedding, so every
token's residual stream leans along u; each block gives expert e a router component b_e u,
b_e falling as log(rank) of the expert in that block's popularity order (a random order per
block). The score then gains b_e (x . u), a bias of one sign for all tokens whose size follows
what the hidden state carries of u: popularity is Zipf-like, with an exponent of about S over
the most used quarter of the experts, and moves with the text as far as the hidden state does
(a token leaning less along u is routed more by its own content). It acts through the hidden
state llama.cpp computes, with no change to the engine; scripts/routing_profile.py measures
the LRU hit-rate curve it gives (docs/bench/synthetic-routing.md).

Spec: "uniform" (default) or "zipf:S", S in (0, 3].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

# b_e per unit of S, in units of the spread of a score's content part: measured on tiny
# qwen35moe / qwen3moe / qwen3next models (scripts/routing_profile.py), a strength of 4.5
# gives a fitted exponent of about 1 over the head of the popularity curve.
STRENGTH_PER_EXPONENT = 4.5


@dataclass(frozen=True)
class Routing:
    zipf: float = 0.0  # popularity exponent; 0 is uniform

    @property
    def uniform(self) -> bool:
        return self.zipf == 0


def parse(spec: str) -> Routing:
    """'uniform' or 'zipf:S'; ValueError saying what is accepted."""
    spec = (spec or "uniform").strip()
    if spec == "uniform":
        return Routing()
    name, _, value = spec.partition(":")
    try:
        zipf = float(value)
    except ValueError:
        zipf = -1.0
    if name != "zipf" or not 0 < zipf <= 3:
        raise ValueError(f"routing {spec!r}: give 'uniform' or 'zipf:S' with S in (0, 3]")
    return Routing(zipf)


def writer(spec: str, config, fill: str, seed: int):
    """A function (name, dims, ggml_type) -> bytes for the tensors routing decides (token
    embedding, routers), None for the others; None when the fill's own weights will do."""
    routing = parse(spec)
    if not config.n_expert or fill in ("sparse", "zeros"):
        return None
    if routing.uniform and fill == "noise":
        return None  # every router weight is drawn already
    rng = np.random.default_rng(seed + 7919)
    u = rng.standard_normal(config.n_embd).astype(np.float32)
    u /= np.linalg.norm(u)

    def write(name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType) -> bytes | None:
        if name == "token_embd.weight" and not routing.uniform:
            return _encode(_embeddings(dims, u, rng), ggml_type)
        if name.endswith("ffn_gate_inp.weight"):
            return _encode(_router(name, dims, routing, u, seed), ggml_type)
        return None

    return write


def _embeddings(dims, u, rng) -> np.ndarray:
    """Token rows: noise of norm about 1, plus u."""
    n_embd, n_vocab = dims
    rows = rng.standard_normal((n_vocab, n_embd), dtype=np.float32) / np.sqrt(n_embd)
    rows += u
    return rows


def _router(name: str, dims, routing: Routing, u, seed: int) -> np.ndarray:
    """Rows w_e, one per expert: noise of norm about 1, plus b_e u by the expert's rank."""
    n_embd, n_expert = dims
    block_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(block_seed)
    rows = rng.standard_normal((n_expert, n_embd), dtype=np.float32) / np.sqrt(n_embd)
    if routing.uniform:
        return rows
    strength = -np.log(rng.permutation(n_expert) + 1.0)  # this block's popularity order
    strength -= strength.mean()
    # A normed hidden state leaning half along u has x . u near sqrt(n_embd) / 2, and a
    # score's noise part has unit spread: b_e below is in units of that spread.
    scale = routing.zipf * STRENGTH_PER_EXPONENT / (np.sqrt(n_embd) / 2)
    rows += (scale * strength).astype(np.float32)[:, None] * u
    return rows


def _encode(rows: np.ndarray, ggml_type: GGMLQuantizationType) -> bytes:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if ggml_type == GGMLQuantizationType.F32:
        return rows.tobytes()
    if ggml_type == GGMLQuantizationType.F16:
        return rows.astype(np.float16).tobytes()
    return gguf_quants.quantize(rows, ggml_type).tobytes()
