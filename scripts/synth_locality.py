"""Attention weights that make a synthetic MoE model's routing follow the recent text.

Random weights route each token by its own content (and, with a Zipf skew, by popularity), so
consecutive tokens share no more experts than popularity gives. Real models route partly by the
recent context. Here every attention block is written to compute a moving average of the last
few tokens, and the routers read it:

- q and k of every head share one constant component, driven by the direction u that every
  token embedding carries, spread over the rotary frequency pairs with a Lorentzian weight.
  RoPE turns q_m . k_n into sum_i a_i cos(theta_i (m - n)): largest at the same position and
  falling with the distance, so the softmax (sharpened through the q and k norms) attends to
  the last few tokens. The attention output is then a moving average of recent tokens' values.
- the values keep out of u (no constant part to settle into), and the output projection
  writes into a subspace R of the stream that token embeddings keep out of, so what R holds
  is the recent context and nothing else;
- every router row gains a random direction inside R, scaled by the gain G: experts are
  chosen partly by the recent past, alike for neighbouring tokens, drifting as the text moves.

Nothing in the engine changes: it is llama.cpp's attention, RoPE and top-k on these weights.
A block before the first attention one (the hybrids' first Gated DeltaNet blocks) finds R empty
and routes by content and popularity only.
"""

from __future__ import annotations

import hashlib

import numpy as np

SUBSPACE = 32  # dimensions of R, the context the routers read
OUT_GAIN = 6.0  # R's spread after all attention blocks, per dimension, over a value's
# 2-D residual branches other than attention: drawn as synth_gguf draws them, kept out of R
KEPT_OUT = ("ssm_out.weight", "ffn_down_shexp.weight", "ffn_down.weight")
WINDOW_RATE = 0.004  # the Lorentzian's width over rotary frequencies: half within ~8 tokens
SHARPNESS = 20.0  # the attention score at distance 0 over the score far away
CONSTANT_SHARE = 16.0  # the constant part's energy in q and k over the token's own part
U_LEAN = 0.45  # x . u / sqrt(n_embd) of a normed hidden state whose embedding carries u


class Locality:
    def __init__(self, config, u: np.ndarray, seed: int, forget: float = 0.0) -> None:
        self.c, self.u = config, u
        # the recurrent blocks' output size: scaled as synth_routing.branch_scale (0) to full (1)
        scaled = 1.0 / np.sqrt(2.0 * config.n_layer)
        self.recurrent_scale = scaled + forget * (1.0 - scaled)
        rng = np.random.default_rng(seed + 104729)
        basis = rng.standard_normal((config.n_embd, SUBSPACE)).astype(np.float32)
        basis -= np.outer(u, u @ basis)  # R is orthogonal to u
        self.basis, _ = np.linalg.qr(basis)  # n_embd x SUBSPACE, orthonormal
        self.gated = config.arch in ("qwen35moe", "qwen3next")
        self.attention_blocks = [i for i in range(config.n_layer) if self._attends(i)]
        self.seed = seed

    def _attends(self, block: int) -> bool:
        f = self.c.full_attention_interval
        return block >= self.c.n_layer or not f or (block + 1) % f == 0

    def _spread(self, block: int) -> float:
        """How much larger a block's normed input is than with scaled recurrent outputs (which
        U_LEAN allows for), as larger ones add to the stream (about recurrent_scale^2 a
        dimension each): x . u and R's share of x shrink by this factor, and the q/k constant
        and the router gain make up for it. 1 when F is 0."""
        recurrent = sum(1 for b in range(block) if not self._attends(b))
        extra = self.recurrent_scale ** 2 - 1.0 / (2.0 * self.c.n_layer)
        return float(np.sqrt(1.0 + recurrent * extra / 1.25))

    def keep_out(self, rows: np.ndarray) -> np.ndarray:
        """Rows (one per token, n_embd wide) without their part in R."""
        return rows - (rows @ self.basis) @ self.basis.T

    def _rng(self, name: str):
        digest = hashlib.sha256(f"{self.seed}:locality:{name}".encode()).digest()[:8]
        return np.random.default_rng(int.from_bytes(digest, "little"))

    def _profile(self) -> np.ndarray:
        """The constant q/k component of one head (head_dim), unit length: amplitude per
        rotary pair (i, i + n_rot/2) by a Lorentzian over its frequency, nothing unrotated."""
        hd = self.c.head_dim
        n_rot = self.c.rope_dims or hd
        theta = self.c.rope_base ** (-2.0 * np.arange(n_rot // 2) / n_rot)
        weight = theta / (WINDOW_RATE ** 2 + theta ** 2)
        weight[theta < WINDOW_RATE / 20] = 0  # pairs that barely turn add only a constant
        out = np.zeros(hd, dtype=np.float32)
        out[:n_rot // 2] = np.sqrt(weight / weight.sum())
        return out

    def _constant(self, rows: np.ndarray, n_heads: int, stride: int, block: int) -> np.ndarray:
        """Add the constant component along u to each head's rows (`stride` rows a head)."""
        hd, n_embd = self.c.head_dim, self.c.n_embd
        # the token's own part is about unit size per dimension; x . u about U_LEAN sqrt(n_embd)
        amplitude = np.sqrt(CONSTANT_SHARE * hd) / (U_LEAN * np.sqrt(n_embd)) * self._spread(block)
        profile = amplitude * self._profile()
        for h in range(n_heads):
            rows[h * stride:h * stride + hd] += np.outer(profile, self.u)
        return rows

    def attention(self, name: str, dims: tuple[int, ...]) -> np.ndarray | None:
        """The rows of an attention tensor written for locality, float; None for the others."""
        if not name.startswith("blk."):
            return None
        if name.endswith(KEPT_OUT):
            n_in, n_out = dims
            rows = self._rng(name).standard_normal((n_out, n_in), dtype=np.float32)
            scale = self.recurrent_scale if name.endswith("ssm_out.weight") else \
                1.0 / np.sqrt(2.0 * self.c.n_layer)  # synth_routing.branch_scale
            rows *= scale / np.sqrt(n_in)
            return rows - self.basis @ (self.basis.T @ rows)
        if ".attn_" not in name:
            return None
        block = int(name.split(".")[1])
        if not self._attends(block):
            return None  # a Gated DeltaNet block's attn_qkv / attn_gate
        kind = name.split(".")[2]
        hd = self.c.head_dim
        if kind in ("attn_q_norm", "attn_k_norm"):
            # q . k / sqrt(hd) at distance 0 is sqrt(hd) w^2 times the constant's share
            share = CONSTANT_SHARE / (CONSTANT_SHARE + 1)
            w = np.sqrt(SHARPNESS / (np.sqrt(hd) * share))
            return np.full(dims[0], w, dtype=np.float32)
        if kind not in ("attn_q", "attn_k", "attn_v", "attn_output"):
            return None
        n_in, n_out = dims
        rng = self._rng(name)
        rows = rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)
        if kind == "attn_q":
            if not self.gated:
                return self._constant(rows, self.c.n_head, hd, block)
            # gated: each head's q, then its gate; a gate of 0 (sigmoid 1/2 for every token)
            # keeps the current token from scaling the average of the recent ones
            for h in range(self.c.n_head):
                rows[(2 * h + 1) * hd:(2 * h + 2) * hd] = 0
            return self._constant(rows, self.c.n_head, 2 * hd, block)
        if kind == "attn_k":
            return self._constant(rows, self.c.n_head_kv, hd, block)
        if kind == "attn_v":
            return rows - np.outer(rows @ self.u, self.u)  # no constant part to average
        # attn_output: into R only, each coordinate about OUT_GAIN times a value's spread once
        # all attention blocks have written
        mix = rng.standard_normal((SUBSPACE, n_in), dtype=np.float32) / np.sqrt(n_in)
        return (self.basis @ mix) * (OUT_GAIN / np.sqrt(len(self.attention_blocks)))

    def router_rows(self, name: str, dims: tuple[int, ...], gain: float) -> np.ndarray:
        """What a block's router rows gain: a random direction in R per expert, at `gain`
        over the spread of a score's content part, scaled to what R holds at that block."""
        n_embd, n_expert = dims
        block = int(name.split(".")[1])
        before = sum(1 for b in self.attention_blocks if b <= block)
        if not before:
            return np.zeros((n_expert, n_embd), dtype=np.float32)
        rng = self._rng(name)
        z = rng.standard_normal((n_expert, SUBSPACE), dtype=np.float32) / np.sqrt(SUBSPACE)
        # R's spread at this block: OUT_GAIN times sqrt(the share of attention blocks so far)
        held = OUT_GAIN * np.sqrt(before / len(self.attention_blocks)) / self._spread(block + 1)
        return (gain / held) * (z @ self.basis.T)
