"""ModelShape from GGUF headers of every synthetic architecture and the real test models: layer
kinds, KV sizes, recurrent state, NextN blocks, experts, tied embeddings."""

from __future__ import annotations

import pytest
import synth_gguf

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
