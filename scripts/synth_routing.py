"""Router weights for synthetic MoE models: uniform, or skewed like a trained model's.

A block's router scores expert e as w_e . x, x the block's normed hidden state, and picks the
top k. With every w_e drawn at random the experts are chosen about uniformly, which no cache
can serve and real models never do. (Before this module, the `random` fill tiled 16 random
rows over every matrix, routers included: experts 16 apart scored alike and the choice was
skewed by accident, by an amount nobody chose. MoE models now draw every dense matrix,
routers included, and tile expert tensors by whole experts: synth_gguf's "moe-random".)

Skewed routing (`zipf:S`): one direction u is added to every token's embedding, so every
token's residual stream leans along u; each block gives expert e a router component b_e u,
b_e falling as log(rank) of the expert in that block's popularity order (a random order per
block). The score then gains b_e (x . u), a bias of one sign for all tokens whose size follows
what the hidden state carries of u: popularity is Zipf-like, with an exponent of about S over
the most used quarter of the experts, and moves with the text as far as the hidden state does
(a token leaning less along u is routed more by its own content). It acts through the hidden
state llama.cpp computes, with no change to the engine; scripts/bench/routing_profile.py measures
the LRU hit-rate curve it gives (docs/synthetic-routing.md).

Local routing (`local:G,S`): the same popularity, plus locality that follows the text. Every
attention block's q and k share one large constant component (along u, which every token
carries), spread over the rotary frequencies so that RoPE scores recent positions highest: the
attention output becomes a moving average of the last few tokens' values. Attention outputs
are written into a subspace that token embeddings keep out of, and every router reads that
subspace with gain G: neighbouring tokens see nearly the same recent past and pick many of the
same experts, and the choice moves as the text does.

Balanced routing (`balanced`): uniform routers behind attention made sharp (its q and k norms
scaled up), so that a deep stack of attention-only blocks does not average every token into one
state that routes alike (uniform qwen3moe models do past a dozen blocks).

Spec: "uniform" (default), "balanced", "zipf:S" with S in (0, 3], "local:G,S" with G in
(0, 20] and S in [0, 3], or "real" (local:REAL_GAIN,REAL_ZIPF: the calibrated one,
docs/synthetic-routing.md).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
from scripts import synth_locality
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

# b_e per unit of S, in units of the spread of a score's content part: measured on tiny
# qwen3moe / qwen35moe / qwen3next models (scripts/bench/routing_profile.py), zipf:1 fits an
# exponent of 1.05 / 1.11 / 1.33 over the head of the popularity curve, zipf:0.5 0.88 / 0.62
# / 0.74 (docs/synthetic-routing.md).
STRENGTH_PER_EXPONENT = 1.0
U_WEIGHT = 0.5  # u's length in a token's embedding, relative to the noise's


REAL_GAIN, REAL_ZIPF = 4.0, 0.3
ACCEPTED = ("give 'uniform', 'balanced', 'zipf:S' (S in (0, 3]), 'local:G,S[,F]' (G in (0, 20], "
            "S in [0, 3], F in [0, 1]) or 'real'")
# balanced: the q and k norms' weight, so that a head's scores spread over several units and
# it attends to a few earlier tokens picked by content and position, not to their average
SHARP_NORM = 2.5


@dataclass(frozen=True)
class Routing:
    zipf: float = 0.0  # popularity exponent; 0 is none
    gain: float = 0.0  # how strongly routers read the recent context; 0 is none
    balanced: bool = False  # uniform routers behind sharp attention (no reuse beyond chance)
    forget: float = 0.0  # local: the recurrent blocks' outputs from scaled (0) to full size (1)

    @property
    def uniform(self) -> bool:
        """Routers drawn at random and the residual branches at full size (no skew)."""
        return self.zipf == 0 and self.gain == 0


def parse(spec: str) -> Routing:
    """'uniform', 'balanced', 'zipf:S', 'local:G,S' or 'real'; ValueError saying what is
    accepted."""
    spec = (spec or "uniform").strip()
    if spec == "uniform":
        return Routing()
    if spec == "balanced":
        return Routing(balanced=True)
    if spec == "real":
        return Routing(REAL_ZIPF, REAL_GAIN)
    name, _, value = spec.partition(":")
    try:
        numbers = [float(v) for v in value.split(",")]
    except ValueError:
        numbers = []
    if name == "zipf" and len(numbers) == 1 and 0 < numbers[0] <= 3:
        return Routing(numbers[0])
    if (name == "local" and len(numbers) in (2, 3) and 0 < numbers[0] <= 20
            and 0 <= numbers[1] <= 3 and 0 <= (numbers[2:] or [0])[0] <= 1):
        return Routing(numbers[1], numbers[0], forget=(numbers[2:] or [0.0])[0])
    raise ValueError(f"routing {spec!r}: {ACCEPTED}")


def writer(spec: str, config, fill: str, seed: int):
    """A function (name, dims, ggml_type) -> bytes for the tensors routing decides (the token
    embedding of any MoE model, skewed routers), None for the others; None when nothing is
    drawn (sparse, zeros) or the model has no experts."""
    routing = parse(spec)
    if not config.n_expert or fill in ("sparse", "zeros"):
        return None
    rng = np.random.default_rng(seed + 7919)
    u = rng.standard_normal(config.n_embd).astype(np.float32)
    u /= np.linalg.norm(u)
    recent = synth_locality.Locality(config, u, seed, routing.forget) if routing.gain else None

    def write(name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType) -> bytes | None:
        if name == "token_embd.weight":
            keep_out = recent.keep_out if recent else None
            return _embeddings(dims, None if routing.uniform else u, rng, ggml_type, keep_out)
        if name.endswith("ffn_gate_inp.weight") and not routing.uniform:
            rows = _router(name, dims, routing, u, seed)
            if recent:
                rows += recent.router_rows(name, dims, routing.gain)
            return _encode(rows, ggml_type)
        if routing.balanced and name.endswith(("attn_q_norm.weight", "attn_k_norm.weight")):
            return np.full(dims[0], SHARP_NORM, dtype=np.float32).tobytes()
        if recent:
            rows = recent.attention(name, dims)
            if rows is not None:
                return rows.tobytes() if rows.ndim == 1 else _encode(rows, ggml_type)
        return None

    return write


# The matrices that write into the residual stream (a block's attention, recurrent and FFN
# outputs). Drawn ~ N(0, 1/fan_in), each adds about as much as the stream already holds, so the
# embedding's lean along u faded block by block and the skew with it: LRU-64 of an 80B-class
# model at zipf:0.8 went from 85% in block 0 to 18% in block 47, and the full-size files routed
# near uniformly past the first blocks that the 4-block toys had been calibrated on. Trained
# models keep their residual branches small; skewed models do too. Uniform ones keep them
# full: their worst case needs hidden states that forget the token (the hybrids' recurrent
# blocks give that; qwen3moe's attention-only blocks instead converge to one state that routes
# every token alike past block 12, see docs/synthetic-routing.md).
RESIDUAL_BRANCHES = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight",
                     "ffn_down_exps.weight", "ffn_down_shexp.weight")


def branch_scale(spec: str, config):
    """name -> the factor for a drawn matrix: 1/sqrt(2 n_layer) for the residual branches of
    a skewed MoE model (GPT-2's initialisation), 1 elsewhere."""
    if parse(spec).uniform or not config.n_expert:
        return lambda name: 1.0
    factor = 1.0 / np.sqrt(2.0 * config.n_layer)
    return lambda name: factor if name.endswith(RESIDUAL_BRANCHES) else 1.0


def _embeddings(dims, u, rng, ggml_type: GGMLQuantizationType, keep_out=None) -> bytes:
    """Token rows, encoded: unit-variance noise (the size of a normed hidden state, so that
    a token stays itself through the blocks: rows of norm 1 were drowned by the first
    attention's average over the context, and every token routed alike), plus u as long as
    the noise for skewed routing; `keep_out(rows)` removes what only attention may write
    (local routing). In slices of 8192 rows (a 248K vocabulary of 2048 is 2 GB as float)."""
    n_embd, n_vocab = dims
    out = []
    for start in range(0, n_vocab, 8192):
        rows = rng.standard_normal((min(8192, n_vocab - start), n_embd), dtype=np.float32)
        if keep_out is not None:
            rows = keep_out(rows)
        if u is not None:
            rows += U_WEIGHT * np.sqrt(n_embd) * u
        out.append(_encode(rows, ggml_type))
    return b"".join(out)


def _router(name: str, dims, routing: Routing, u, seed: int) -> np.ndarray:
    """Rows w_e, one per expert: noise of norm about 1, plus b_e u by the expert's rank."""
    n_embd, n_expert = dims
    block_seed = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    rng = np.random.default_rng(block_seed)
    rows = rng.standard_normal((n_expert, n_embd), dtype=np.float32) / np.sqrt(n_embd)
    if routing.uniform:
        return rows
    if not routing.zipf:
        return rows
    strength = -np.log(rng.permutation(n_expert) + 1.0)  # this block's popularity order
    strength -= strength.mean()
    # A normed hidden state (length sqrt(n_embd)) leaning along u has x . u of the order of
    # sqrt(n_embd) / 2, and a score's noise part has unit spread: b_e is in those units.
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
