"""Synthetic MoE routing, measured in llama.cpp: the expert ids its eval callback reads from
each block's ffn_moe_topk while a tiny model reads real text, and the LRU hit rates they give."""

from __future__ import annotations

from dataclasses import replace

import pytest
from scripts.bench import routing_profile
from scripts import synth_gguf
from scripts import synth_routing


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
        with pytest.raises(ValueError, match="give 'uniform', 'balanced', 'zipf:S'"):
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


def test_local_routing_specs_parse_and_bad_ones_say_what_is_accepted():
    assert synth_routing.parse("local:4,0.5") == synth_routing.Routing(zipf=0.5, gain=4.0)
    assert synth_routing.parse("local:4,0") == synth_routing.Routing(zipf=0.0, gain=4.0)
    assert not synth_routing.parse("local:4,0").uniform
    assert synth_routing.parse("local:2,0,1") == synth_routing.Routing(0.0, 2.0, forget=1.0)
    assert synth_routing.parse("balanced").balanced and synth_routing.parse("balanced").uniform
    real = synth_routing.parse("real")
    assert (real.gain, real.zipf) == (synth_routing.REAL_GAIN, synth_routing.REAL_ZIPF)
    for bad in ("local", "local:4", "local:0,0.5", "local:30,0.5", "local:4,5", "local:a,b",
                "local:4,0.5,2", "local:4,0.5,1,1", "zipf:0.3,1"):
        with pytest.raises(ValueError, match=r"'local:G,S\[,F\]' \(G in \(0, 20\]"):
            synth_routing.parse(bad)


def test_reuse_within_counts_experts_seen_in_the_window():
    seq = [(1, 2), (3, 4), (1, 3), (5, 6)]
    # token 1: none of 3, 4 seen; token 2: 1 and 3 both seen; token 3: neither 5 nor 6
    assert routing_profile.reuse_within(seq, 8) == pytest.approx(1 / 3)
    # a window of 1: token 2 sees only (3, 4), so half of its experts
    assert routing_profile.reuse_within(seq, 1) == pytest.approx(0.5 / 3)


def test_an_lru_warmed_by_a_prompt_counts_only_the_answer():
    seq = [(1, 2), (3, 4), (1, 2), (3, 5)]
    assert routing_profile.lru_hit_rate(seq, 4) == pytest.approx(3 / 8)
    assert routing_profile.lru_hit_rate(seq, 4, counted_from=2) == pytest.approx(3 / 4)
    from scripts.bench.pool_replay import lru_replay
    blocks = {0: seq, 1: [(7, 8)] * 4}  # the first block's rate, then a block that always hits
    assert lru_replay(blocks, 4, 1, 2, first=True) == pytest.approx(3 / 4)
    assert lru_replay(blocks, 4, 1, 2) == pytest.approx(1.0)
    assert lru_replay(blocks, 4, 2, 2) == pytest.approx((3 / 4 + 1.0) / 2)


def test_a_prompt_read_in_micro_batches_fills_the_pool_from_its_first():
    """The engine learns a prompt a micro-batch at a time: the free slots fill from the first,
    later ones evict at most the swaps a step. Replayed in one batch the pool holds the whole
    prompt's hottest experts; in micro-batches of 4, the first's."""
    from scripts.bench.pool_replay import replay
    prompt = [(0,), (0,), (1,), (1,)] + [(2,), (3,)] * 4
    blocks = {0: prompt + [(2,), (3,)]}  # the answer: two steps on the prompt's hottest
    one_batch = replay(blocks, 4, 2, 1, 0.95, swaps=0, answers=1, tokens=2)
    in_fours = replay(blocks, 4, 2, 1, 0.95, swaps=0, answers=1, tokens=2, ubatch=4)
    assert one_batch[0][0] == pytest.approx(1.0)
    assert in_fours[0][0] == pytest.approx(0.0)


def test_local_routing_makes_neighbouring_tokens_share_experts(tmp_path):
    """Uniform routers pick each token's experts by its own content; local routing's attention
    averages the last few tokens and the routers read that average, so the next token reuses
    far more of them (real models: about 45% on Qwen3-30B-A3B). Balanced routing reuses
    less than uniform, near chance."""
    text = routing_profile.corpus(500)
    config = routing_profile.tiny_moe("qwen3-30b-a3b", blocks=6)  # 128 experts, 8 per token
    out = {}
    for spec in ("uniform", "local:4,0", "balanced"):
        path = synth_gguf.write_gguf(tmp_path / f"{spec.replace(':', '_')}.gguf", config,
                                     "Q8_0", "random", routing=spec)
        blocks, n_expert, _ = routing_profile.route(str(path), text)
        out[spec] = routing_profile.profile(blocks, n_expert)
    assert out["local:4,0"]["next_token_overlap"] > out["uniform"]["next_token_overlap"] + 0.15
    assert out["local:4,0"]["within8"] > out["uniform"]["within8"]
    # the adversarial spec: uniform qwen3moe blocks average tokens alike as they get deeper
    # (0.17 here, 0.31 at 48 blocks); sharp attention keeps them apart (chance: 8/128)
    assert out["balanced"]["next_token_overlap"] < out["uniform"]["next_token_overlap"] - 0.03


def test_the_benchmark_text_does_not_repeat():
    """A repeated list of words routed the benchmark's prompts to the same experts over and
    over; its prompts are now seeded words that do not repeat."""
    from scripts.bench import bench_text

    text = bench_text.text_of(16384, 2)
    words = text.split()
    assert len(text) == 16384 and len(set(words)) > 0.9 * len(words)
    assert bench_text.text_of(16384, 2) == text != bench_text.text_of(16384, 3)
    chunks = {text[i:i + 64] for i in range(0, len(text) - 64, 64)}
    assert len(chunks) == (len(text) - 1) // 64  # no 64-character stretch twice
