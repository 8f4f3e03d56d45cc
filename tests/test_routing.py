"""Synthetic MoE routing, measured in llama.cpp: the expert ids its eval callback reads from
each block's ffn_moe_topk while a tiny model reads real text, and the LRU hit rates they give."""

from __future__ import annotations

from dataclasses import replace

import pytest
import routing_profile
import synth_gguf
import synth_routing


@pytest.fixture(scope="module")
def text():
    return routing_profile.corpus(1200)


def _profile(tmp_path, text, routing: str, fill: str = "noise") -> dict:
    config = routing_profile.tiny_moe("qwen35-35b-a3b")  # 256 experts, 8 per token
    path = synth_gguf.write_gguf(tmp_path / f"{routing.replace(':', '')}-{fill}.gguf", config,
                                 "Q8_0", fill, routing=routing)
    blocks, n_expert, n_used = routing_profile.route(str(path), text)
    assert (n_expert, n_used) == (256, 8)
    assert len(blocks) == config.n_layer  # the trunk's blocks (the MTP block is not run)
    return routing_profile.profile(blocks, n_expert)


def test_zipf_routing_hits_an_lru_far_more_than_uniform(tmp_path, text):
    uniform = _profile(tmp_path, text, "uniform")
    skewed = _profile(tmp_path, text, "zipf:0.6")
    assert skewed["tokens"] == uniform["tokens"] > 1000
    # 64 of 256 experts per block: uniform routing hits not much more than 64/256 of lookups
    assert uniform["lru"][64] < 0.45
    assert skewed["lru"][64] > uniform["lru"][64] + 0.15
    assert uniform["zipf_exponent"] < 0.5 < skewed["zipf_exponent"]


def test_random_fill_routes_by_the_routers_not_by_tiled_rows(tmp_path, text):
    """The disk-speed fill of big files: with rows tiled 16 at a time every hidden state fell
    in a 16-dimensional span and a few experts took most lookups whatever the routers."""
    uniform = _profile(tmp_path, text, "uniform", "random")
    assert uniform["lru"][64] < 0.45 and uniform["zipf_exponent"] < 0.5


def test_routing_spec_errors_say_what_is_accepted(tmp_path):
    assert synth_routing.parse("zipf:0.8") == synth_routing.Routing(0.8)
    assert synth_routing.parse("uniform").uniform
    for bad in ("zipf", "zipf:0", "zipf:5", "pareto:1", "zipf:x"):
        with pytest.raises(ValueError, match="give 'uniform' or 'zipf:S'"):
            synth_routing.parse(bad)
    config = synth_gguf.tiny(synth_gguf.SHAPES["qwen35-35b-a3b"])
    assert synth_gguf.main(["qwen35-35b-a3b", str(tmp_path / "x.gguf"), "--tiny",
                            "--routing", "zipf:9"]) == 1
    assert not (tmp_path / "x.gguf").exists()
    path = synth_gguf.ensure_model(tmp_path, replace(config, name="t"), "Q8_0", "zipf:0.6")
    assert path.name == "t-q8_0-zipf0.6.gguf" and path.exists()


def test_skew_holds_through_the_real_depth(tmp_path, text):
    """Residual branches drawn at full size drowned the embedding's lean along u block by
    block: at 48 blocks and zipf:0.8 an LRU of 64 hit 85% in block 0 and 18% in block 47 (22%
    is uniform), so the full-size benchmark files routed near uniformly past their first
    blocks. Skewed models draw their residual branches small, as trained models keep them."""
    config = routing_profile.tiny_moe("qwen35-35b-a3b", blocks=24)
    path = synth_gguf.write_gguf(tmp_path / "deep.gguf", config, "Q8_0", "random",
                                 routing="zipf:0.3")
    blocks, n_expert, _ = routing_profile.route(str(path), text)
    assert len(blocks) == 24 and n_expert == 256
    rates = routing_profile.per_block(blocks, 64)
    first, last = sum(rates[:6]) / 6, sum(rates[-6:]) / 6
    assert last > 0.5, rates  # uniform: about 0.27 at this depth
    assert last > 0.75 * first, rates
    assert synth_routing.branch_scale("uniform", config)("blk.3.ffn_down_exps.weight") == 1.0
