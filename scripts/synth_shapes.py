"""The named model shapes synth_gguf.py writes: each one's hyperparameters (GGUF metadata
names), toy and fewer-expert variants of a shape, and the tensor table llama.cpp loads for it,
named and shaped as llama.cpp names and shapes them. What the file holds (tensor types, metadata,
weights) is synth_gguf.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ShapeConfig:
    """The hyperparameters that decide a model's tensor table (GGUF metadata names)."""

    name: str
    arch: str  # llama, qwen35, gemma3, qwen3moe, qwen35moe, qwen3next, gpt-oss
    n_layer: int  # trunk blocks (NextN blocks come on top)
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    context_length: int
    tied_embeddings: bool = False
    n_nextn: int = 0
    sliding_window: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_expert: int = 0
    n_ff_shexp: int = 0  # the shared expert's width (qwen35moe, qwen3next: one per block)
    full_attention_interval: int = 0  # qwen35: every Nth block attends, the others are recurrent
    ssm: dict = field(default_factory=dict)  # qwen35: d_conv, d_state, n_group, dt_rank
    rope_dims: int = 0  # 0: the head size
    rope_base: float = 10000.0


SHAPES: dict[str, ShapeConfig] = {
    # Llama 3.2 1B: the "1B" of the H200 comparisons with llama-bench and llama-server.
    "llama-1b": ShapeConfig(
        "llama-1b", "llama", n_layer=16, n_embd=2048, n_ff=8192, n_head=32, n_head_kv=8,
        head_dim=64, n_vocab=128256, context_length=131072, tied_embeddings=True,
        rope_base=500000.0),
    "llama-8b": ShapeConfig(
        "llama-8b", "llama", n_layer=32, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8,
        head_dim=128, n_vocab=128256, context_length=131072, rope_base=500000.0),
    # The 27B-class dense model of the H200 baselines: 66 blocks, 8 KV heads x 128, 13.9 GiB Q4_0.
    "dense-27b": ShapeConfig(
        "dense-27b", "llama", n_layer=66, n_embd=5120, n_ff=20480, n_head=40, n_head_kv=8,
        head_dim=128, n_vocab=152064, context_length=131072, rope_base=1000000.0),
    # Qwen3.5/3.6-27B: 16 x (3 Gated DeltaNet + 1 gated attention) and one NextN (MTP) block.
    "qwen35-27b": ShapeConfig(
        "qwen35-27b", "qwen35", n_layer=64, n_embd=5120, n_ff=17408, n_head=24, n_head_kv=4,
        head_dim=256, n_vocab=248320, context_length=262144, n_nextn=1,
        full_attention_interval=4, ssm={"d_conv": 4, "d_state": 128, "n_group": 16, "dt_rank": 48},
        rope_dims=64, rope_base=10000000.0),
    # Gemma 3 27B: 5 sliding-window (1024) blocks per global one, tied embeddings.
    "gemma3-27b": ShapeConfig(
        "gemma3-27b", "gemma3", n_layer=62, n_embd=5376, n_ff=21504, n_head=32, n_head_kv=16,
        head_dim=128, n_vocab=262208, context_length=131072, tied_embeddings=True,
        sliding_window=1024, rope_base=1000000.0),
    "qwen3-30b-a3b": ShapeConfig(
        "qwen3-30b-a3b", "qwen3moe", n_layer=48, n_embd=2048, n_ff=6144, n_head=32, n_head_kv=4,
        head_dim=128, n_vocab=151936, context_length=40960, n_expert=128, n_expert_used=8,
        n_ff_expert=768, rope_base=1000000.0),
    # Qwen3.5/3.6-35B-A3B (HF config.json, text_config of Qwen/Qwen3.6-35B-A3B, as quoted in
    # /work/shared/reference/models-and-cards.md 1c): 40 = 10 x (3 Gated DeltaNet + 1 gated
    # attention) blocks of 2048, attention 16 Q / 2 KV heads of 256, GDN 16 key / 32 value heads
    # of 128, conv 4; 256 experts of 512, 8 routed + 1 shared of 512; vocab 248320; 262144
    # context; rope theta 1e7 on 25% of the head (64 dims, M-RoPE); mtp_num_hidden_layers 1.
    "qwen35-35b-a3b": ShapeConfig(
        "qwen35-35b-a3b", "qwen35moe", n_layer=40, n_embd=2048, n_ff=0, n_head=16, n_head_kv=2,
        head_dim=256, n_vocab=248320, context_length=262144, n_nextn=1, n_expert=256,
        n_expert_used=8, n_ff_expert=512, n_ff_shexp=512, full_attention_interval=4,
        ssm={"d_conv": 4, "d_state": 128, "n_group": 16, "dt_rank": 32}, rope_dims=64,
        rope_base=10000000.0),
    # Qwen3-Next-80B-A3B (HF config.json of Qwen/Qwen3-Next-80B-A3B-Instruct): 48 = 12 x (3
    # Gated DeltaNet + 1 gated attention) blocks of 2048, intermediate 5120, attention 16 Q /
    # 2 KV heads of 256, GDN 16 key / 32 value heads of 128, conv 4; 512 experts of 512, 10
    # routed + 1 shared of 512; vocab 151936; 262144 context; rope theta 1e7 on 25% of the
    # head (64 dims, NeoX); one MTP block (llama.cpp's converter appends it).
    "qwen3-next-80b-a3b": ShapeConfig(
        "qwen3-next-80b-a3b", "qwen3next", n_layer=48, n_embd=2048, n_ff=5120, n_head=16,
        n_head_kv=2, head_dim=256, n_vocab=151936, context_length=262144, n_nextn=1,
        n_expert=512, n_expert_used=10, n_ff_expert=512, n_ff_shexp=512,
        full_attention_interval=4, ssm={"d_conv": 4, "d_state": 128, "n_group": 16, "dt_rank": 32},
        rope_dims=64, rope_base=10000000.0),
    # gpt-oss-20b / -120b (HF config.json of openai/gpt-oss-*): 24 / 36 blocks of 2880,
    # 64 Q / 8 KV heads of 64, attention sinks, every other block sliding (window 128);
    # 32 / 128 experts of 2880, 4 routed, MXFP4 experts; vocab 201088; 131072 context; rope
    # theta 150000. The experts are MXFP4 whatever --type says (as in the published GGUFs).
    "gpt-oss-20b": ShapeConfig(
        "gpt-oss-20b", "gpt-oss", n_layer=24, n_embd=2880, n_ff=0, n_head=64, n_head_kv=8,
        head_dim=64, n_vocab=201088, context_length=131072, sliding_window=128, n_expert=32,
        n_expert_used=4, n_ff_expert=2880, rope_base=150000.0),
    "gpt-oss-120b": ShapeConfig(
        "gpt-oss-120b", "gpt-oss", n_layer=36, n_embd=2880, n_ff=0, n_head=64, n_head_kv=8,
        head_dim=64, n_vocab=201088, context_length=131072, sliding_window=128, n_expert=128,
        n_expert_used=4, n_ff_expert=2880, rope_base=150000.0),
    "70b": ShapeConfig(
        "70b", "llama", n_layer=80, n_embd=8192, n_ff=28672, n_head=64, n_head_kv=8,
        head_dim=128, n_vocab=128256, context_length=131072, rope_base=500000.0),
}


def tiny(config: ShapeConfig) -> ShapeConfig:
    """The same architecture at toy size: loads and decodes on a CPU in well under a second."""
    n_layer = {"gemma3": 6, "qwen35": 4, "qwen35moe": 4, "qwen3next": 4}.get(config.arch, 2)
    ssm = {"d_conv": 4, "d_state": 32, "n_group": 2, "dt_rank": 4} if config.ssm else {}
    return replace(
        config, name=f"{config.name}-tiny", n_layer=n_layer, n_embd=256, n_head=4,
        n_head_kv=2, head_dim=64, n_vocab=512, context_length=4096,
        sliding_window=128 if config.sliding_window else 0,
        n_expert=8 if config.n_expert else 0, n_expert_used=2 if config.n_expert else 0,
        n_ff_expert=256 if config.n_expert else 0, ssm=ssm,
        n_ff_shexp=256 if config.n_ff_shexp else 0, n_ff=512 if config.n_ff else 0,
        rope_dims=32 if config.rope_dims else 0,
    )


def fewer_experts(config: ShapeConfig, n: int) -> ShapeConfig:
    """The shape with `n` experts a block (at least its routed ones) where it has more: with
    every expert on the GPU a decode step reads only the routed experts, so the step is the
    same work as the real shape's from a file a tenth of the size (bench_resident.py)."""
    if not n or not config.n_expert or n >= config.n_expert:
        return config
    n = max(n, config.n_expert_used)
    return replace(config, name=f"{config.name}-e{n}", n_expert=n)


# ---- the tensor table ------------------------------------------------------------------------

Tensor = tuple[str, tuple[int, ...]]  # name, ggml dims (ne0 first: the input size)


def tensor_table(c: ShapeConfig) -> list[Tensor]:
    """Every tensor llama.cpp loads for this architecture, named and shaped as llama.cpp does."""
    E, V = c.n_embd, c.n_vocab
    q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    out: list[Tensor] = [("token_embd.weight", (E, V)), ("output_norm.weight", (E,))]
    if not c.tied_embeddings:
        out.append(("output.weight", (E, V)))

    def ffn(b: str) -> list[Tensor]:
        return [(f"{b}.ffn_gate.weight", (E, c.n_ff)), (f"{b}.ffn_up.weight", (E, c.n_ff)),
                (f"{b}.ffn_down.weight", (c.n_ff, E))]

    def experts(b: str) -> list[Tensor]:
        F, X = c.n_ff_expert, c.n_expert
        return [(f"{b}.ffn_gate_inp.weight", (E, X)), (f"{b}.ffn_gate_exps.weight", (E, F, X)),
                (f"{b}.ffn_down_exps.weight", (F, E, X)), (f"{b}.ffn_up_exps.weight", (E, F, X))]

    def shared_expert(b: str) -> list[Tensor]:
        S = c.n_ff_shexp
        return [(f"{b}.ffn_gate_inp_shexp.weight", (E,)), (f"{b}.ffn_gate_shexp.weight", (E, S)),
                (f"{b}.ffn_up_shexp.weight", (E, S)), (f"{b}.ffn_down_shexp.weight", (S, E))]

    for i in range(c.n_layer + c.n_nextn):
        b = f"blk.{i}"
        if c.arch == "llama":
            out += [(f"{b}.attn_norm.weight", (E,)), (f"{b}.attn_q.weight", (E, q_dim)),
                    (f"{b}.attn_k.weight", (E, kv_dim)), (f"{b}.attn_v.weight", (E, kv_dim)),
                    (f"{b}.attn_output.weight", (q_dim, E)), (f"{b}.ffn_norm.weight", (E,))]
            out += ffn(b)
        elif c.arch == "gemma3":
            out += [(f"{b}.attn_norm.weight", (E,)), (f"{b}.attn_q.weight", (E, q_dim)),
                    (f"{b}.attn_k.weight", (E, kv_dim)), (f"{b}.attn_v.weight", (E, kv_dim)),
                    (f"{b}.attn_output.weight", (q_dim, E)),
                    (f"{b}.post_attention_norm.weight", (E,)),
                    (f"{b}.attn_k_norm.weight", (c.head_dim,)),
                    (f"{b}.attn_q_norm.weight", (c.head_dim,)), (f"{b}.ffn_norm.weight", (E,))]
            out += ffn(b) + [(f"{b}.post_ffw_norm.weight", (E,))]
        elif c.arch == "qwen3moe":
            out += [(f"{b}.attn_norm.weight", (E,)), (f"{b}.attn_q.weight", (E, q_dim)),
                    (f"{b}.attn_k.weight", (E, kv_dim)), (f"{b}.attn_v.weight", (E, kv_dim)),
                    (f"{b}.attn_output.weight", (q_dim, E)),
                    (f"{b}.attn_k_norm.weight", (c.head_dim,)),
                    (f"{b}.attn_q_norm.weight", (c.head_dim,)), (f"{b}.ffn_norm.weight", (E,))]
            out += experts(b)
        elif c.arch == "qwen35":
            out += _qwen35_block(c, i, b) + ffn(b)
        elif c.arch in ("qwen35moe", "qwen3next"):
            # Every block, the MTP one included, has 256/512 routed experts and a shared one.
            out += _qwen35_block(c, i, b) + experts(b) + shared_expert(b)
        elif c.arch == "gpt-oss":
            F, X = c.n_ff_expert, c.n_expert
            out += [(f"{b}.attn_norm.weight", (E,)), (f"{b}.post_attention_norm.weight", (E,)),
                    (f"{b}.attn_q.weight", (E, q_dim)), (f"{b}.attn_q.bias", (q_dim,)),
                    (f"{b}.attn_k.weight", (E, kv_dim)), (f"{b}.attn_k.bias", (kv_dim,)),
                    (f"{b}.attn_v.weight", (E, kv_dim)), (f"{b}.attn_v.bias", (kv_dim,)),
                    (f"{b}.attn_output.weight", (q_dim, E)), (f"{b}.attn_output.bias", (E,)),
                    (f"{b}.attn_sinks.weight", (c.n_head,))]
            out += experts(b) + [
                (f"{b}.ffn_gate_inp.bias", (X,)), (f"{b}.ffn_gate_exps.bias", (F, X)),
                (f"{b}.ffn_down_exps.bias", (E, X)), (f"{b}.ffn_up_exps.bias", (F, X))]
        else:
            raise ValueError(f"no tensor table for architecture {c.arch}")
    return out


def _qwen35_block(c: ShapeConfig, i: int, b: str) -> list[Tensor]:
    E = c.n_embd
    q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
    out: list[Tensor] = [(f"{b}.attn_norm.weight", (E,)), (f"{b}.post_attention_norm.weight", (E,))]
    is_nextn = i >= c.n_layer
    if is_nextn or (i + 1) % c.full_attention_interval == 0:
        # Gated attention: Q and its gate share one projection (2 x q_dim).
        out += [(f"{b}.attn_q.weight", (E, 2 * q_dim)), (f"{b}.attn_k.weight", (E, kv_dim)),
                (f"{b}.attn_v.weight", (E, kv_dim)), (f"{b}.attn_output.weight", (q_dim, E)),
                (f"{b}.attn_q_norm.weight", (c.head_dim,)),
                (f"{b}.attn_k_norm.weight", (c.head_dim,))]
        if is_nextn:
            out += [(f"{b}.nextn.eh_proj.weight", (2 * E, E)), (f"{b}.nextn.enorm.weight", (E,)),
                    (f"{b}.nextn.hnorm.weight", (E,)),
                    (f"{b}.nextn.shared_head_norm.weight", (E,))]
        return out
    s = c.ssm
    key_dim, value_dim = s["d_state"] * s["n_group"], s["d_state"] * s["dt_rank"]
    conv_dim = 2 * key_dim + value_dim
    # Qwen3-Next fuses the beta and alpha projections into one (ssm_ba); Qwen3.5 keeps two.
    gates = ([(f"{b}.ssm_ba.weight", (E, 2 * s["dt_rank"]))] if c.arch == "qwen3next" else
             [(f"{b}.ssm_beta.weight", (E, s["dt_rank"])),
              (f"{b}.ssm_alpha.weight", (E, s["dt_rank"]))])
    return out + [
        (f"{b}.attn_qkv.weight", (E, conv_dim)), (f"{b}.attn_gate.weight", (E, value_dim)),
        (f"{b}.ssm_conv1d.weight", (s["d_conv"], conv_dim)), (f"{b}.ssm_dt.bias", (s["dt_rank"],)),
        (f"{b}.ssm_a", (s["dt_rank"],))] + gates + [
        (f"{b}.ssm_norm.weight", (s["d_state"],)), (f"{b}.ssm_out.weight", (value_dim, E)),
    ]

