"""ModelShape from GGUF headers of every synthetic architecture and the real test models: layer
kinds, KV sizes, recurrent state, NextN blocks, experts, tied embeddings."""

from __future__ import annotations

import pytest
from scripts import synth_gguf

from localllm.modelstore.shape import (
    EXPERTS, FULL, RECURRENT_LAYER, SLIDING, read_shape,
)

KIB, MIB = 1 << 10, 1 << 20


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return {name: read_shape(path) for name, path in paths.items()}


def kinds(shape):
    out = {}
    for layer in shape.layers:
        out[layer.kind] = out.get(layer.kind, 0) + 1
    return out


def test_f16_kv_per_token_matches_the_reference_table(shapes):
    # models-and-cards.md section 2: f16 KV per token over the attention layers
    assert shapes["qwen35-27b"].kv_bytes_per_token(2, 2) == 64 * KIB
    assert shapes["qwen3-30b-a3b"].kv_bytes_per_token(2, 2) == 96 * KIB
    assert shapes["llama-8b"].kv_bytes_per_token(2, 2) == 128 * KIB
    assert shapes["gemma3-27b"].kv_bytes_per_token(2, 2) == 80 * KIB  # the 10 global layers


def test_qwen35_hybrid_with_nextn(shapes):
    s = shapes["qwen35-27b"]
    assert s.n_layer == 65 and s.n_nextn == 1 and s.n_layer_main == 64
    assert kinds(s) == {RECURRENT_LAYER: 48, FULL: 17}  # 16 attention + the NextN block
    assert [layer.index for layer in s.layers if layer.kind == FULL][:3] == [3, 7, 11]
    assert s.layers[-1].is_nextn and s.layers[-1].kind == FULL
    # 48 x (S 128 x 6144 + conv 3 x (6144 + 2 x 16 x 128)) f32 = 149.62 MiB (llama.cpp's log)
    assert s.recurrent_state_bytes == 48 * (128 * 6144 + 3 * (6144 + 2 * 16 * 128)) * 4
    assert round(s.recurrent_state_bytes / MIB, 2) == 149.62
    assert s.context_length == 262144 and not s.tied_embeddings


def test_gemma3_sliding_window_and_tied_embeddings(shapes):
    s = shapes["gemma3-27b"]
    assert kinds(s) == {SLIDING: 52, FULL: 10} and s.sliding_window == 1024
    assert [layer.index for layer in s.layers if layer.kind == FULL][:2] == [5, 11]
    assert s.tied_embeddings and s.output_bytes == s.embedding_bytes > 0


def test_moe_experts_are_their_own_role(shapes):
    s = shapes["qwen3-30b-a3b"]
    assert s.expert_count == 128 and s.expert_used_count == 8
    assert s.expert_feed_forward_length == 768
    experts = s.role_bytes(EXPERTS)
    assert experts == sum(layer.expert_bytes for layer in s.layers)
    assert experts > 0.8 * s.weight_bytes  # the experts are most of an MoE model


def test_dense_models_are_all_full_attention(shapes):
    for name in ("llama-8b", "dense-27b", "70b"):
        s = shapes[name]
        assert kinds(s) == {FULL: s.n_layer}
        assert s.feed_forward_length == synth_gguf.SHAPES[name].n_ff
        assert s.output_bytes > 0 and not s.tied_embeddings


def test_real_gemma_270m(gemma_gguf):
    s = read_shape(gemma_gguf)
    assert s.architecture == "gemma3" and s.n_layer == 18
    assert kinds(s) == {SLIDING: 15, FULL: 3} and s.sliding_window == 512
    assert s.tied_embeddings and s.context_length == 32768


def _block_bytes(shape, layer, part):
    return sum(t.n_bytes for t in shape.tensors if t.layer == layer and part in t.name)


def test_qwen35_moe_hybrid_with_shared_expert_and_nextn(shapes):
    s = shapes["qwen35-35b-a3b"]
    # 40 = 10 x (3 Gated DeltaNet + 1 attention), then the MTP block; read from the
    # recurrent_layers flags the converter writes
    assert s.architecture == "qwen35moe" and s.n_layer == 41 and s.n_nextn == 1
    assert kinds(s) == {RECURRENT_LAYER: 30, FULL: 11}
    assert [layer.index for layer in s.layers if layer.kind == FULL][:3] == [3, 7, 11]
    # models-and-cards.md section 2: 20 KiB f16 KV per token, GDN state 62.8 MiB (30 layers)
    assert s.kv_bytes_per_token(2, 2) == 20 * KIB
    assert s.recurrent_state_bytes == 30 * (3 * (4096 + 2 * 16 * 128) + 128 * 4096) * 4
    assert round(s.recurrent_state_bytes / MIB, 1) == 62.8
    assert (s.expert_count, s.expert_used_count, s.expert_feed_forward_length) == (256, 8, 512)
    assert s.expert_shared_feed_forward_length == 512
    # 3 matrices of 2048 x 512 per expert, Q4_0 (18 bytes per 32 weights), in every block and
    # in the MTP block
    per_block = 3 * 2048 * 512 * 256 // 32 * 18
    assert all(layer.expert_bytes == per_block for layer in s.layers)
    # the shared expert: 3 matrices of 2048 x 512 and its f32 gate, not counted as experts
    shared = 3 * 2048 * 512 // 32 * 18 + 2048 * 4
    assert all(layer.shared_expert_bytes == shared for layer in s.layers)
    assert s.layers[0].shared_expert_bytes == _block_bytes(s, 0, "_shexp")
    assert s.role_bytes(EXPERTS) == 41 * per_block
    assert s.layers[-1].is_nextn and s.layers[-1].kind == FULL


def test_qwen3_next_80b_class(shapes):
    s = shapes["qwen3-next-80b-a3b"]
    assert s.architecture == "qwen3next" and s.n_layer == 49 and s.n_nextn == 1
    assert kinds(s) == {RECURRENT_LAYER: 36, FULL: 13}  # by full_attention_interval
    assert s.kv_bytes_per_token(2, 2) == 12 * 2 * 256 * 2 * 2
    assert s.recurrent_state_bytes == 36 * (3 * (4096 + 2 * 16 * 128) + 128 * 4096) * 4
    assert (s.expert_count, s.expert_used_count) == (512, 10)
    assert s.layers[0].expert_bytes == 3 * 2048 * 512 * 512 // 32 * 18
    assert s.expert_shared_feed_forward_length == 512 and s.layers[0].shared_expert_bytes > 0
    assert not any(t.name.endswith("ssm_beta.weight") for t in s.tensors)  # fused: ssm_ba
    assert s.weight_bytes > 40 * (1 << 30)  # the 80B class: past a 12 GiB card and 32 GiB RAM


def test_gpt_oss_sliding_every_other_block_with_mxfp4_experts(shapes):
    s = shapes["gpt-oss-120b"]
    assert kinds(s) == {SLIDING: 18, FULL: 18} and s.sliding_window == 128
    assert [layer.kind for layer in s.layers[:2]] == [SLIDING, FULL]
    assert {t.ggml_type for t in s.tensors if t.name.endswith("_exps.weight")} == {"MXFP4"}
    assert any(t.name == "blk.0.attn_sinks.weight" for t in s.tensors)
    # 3 x 2880 x 2880 x 128 MXFP4 (17 bytes per 32) and the experts' f32 biases
    weights = 3 * 2880 * 2880 * 128 // 32 * 17
    biases = (2 * 2880 + 2880) * 128 * 4
    assert s.layers[0].expert_bytes == weights + biases
    assert s.kv_bytes_per_token(2, 2) == 18 * 8 * 64 * 2 * 2  # the full-attention blocks


def test_fewer_experts_keep_a_decode_steps_work(tmp_path):
    """bench_resident.py's files: the same routed bytes and per-block layout a token, a fraction
    of the file."""
    from localllm.planner.costs import model_costs

    for name in ("qwen35-35b-a3b", "qwen3-next-80b-a3b"):
        real = synth_gguf.SHAPES[name]
        small = synth_gguf.fewer_experts(real, 16)
        assert (small.n_expert, small.n_expert_used) == (16, real.n_expert_used)
        full = model_costs(read_shape(synth_gguf.write_gguf(tmp_path / f"{name}.gguf", real)))
        cut = model_costs(read_shape(synth_gguf.write_gguf(tmp_path / f"{name}-16.gguf", small)))
        routed = [b * full.expert_active_fraction for b in full.expert_bytes]
        assert [b * cut.expert_active_fraction for b in cut.expert_bytes] == pytest.approx(routed)
        assert cut.state_bytes == full.state_bytes and cut.kinds == full.kinds
        assert sum(cut.expert_bytes) * 4 < sum(full.expert_bytes)
    dense = synth_gguf.SHAPES["llama-8b"]
    assert synth_gguf.fewer_experts(dense, 16) is dense
