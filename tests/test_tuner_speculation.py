"""Issue 10's planning half: speculative decoding planned with the placement. The speed model
prices a checking pass per device (calibrated to the H200's llama-bench ppB runs), the tuner
turns speculation on where it pays and off where it does not, says why, and counts the
drafter's memory (NextN block and its KV, or a draft model) inside the budget."""

from __future__ import annotations

import re

from dataclasses import replace

import pytest
from scripts import synth_gguf

from localllm.cli.main import main
from localllm.modelstore.shape import read_shape
from localllm.planner import speculation
from localllm.planner.card import GIB, MIB, load_card
from localllm.profiles.choose import placement_of, settings_of
from localllm.planner.costs import model_costs
from localllm.planner.memory import ContextSettings, memory_by_device
from localllm.planner.placements import Placement
from localllm.planner.plan import Plan
from localllm.profiles.saved import ProfileError, find_profile, profile_path, save_profile
from localllm.planner.checking import checking_cost, checking_terms
from localllm.planner.budgets import ram_budget, vram_budget
from localllm.planner.search import Request
from localllm.planner.tuner import tune

HOST = dict(ram_bytes=64 * GIB, cores=8, host_bandwidth_gbs=50.0)
H200_HOST = dict(ram_bytes=128 * GIB, cores=16, host_bandwidth_gbs=51.2)
CARDS = ("rtx4060", "rtx3060-12g", "rtx4060ti-16g", "rtx3090", "a100-80g")
# A 1B-class draft for dense-27b: llama-1b's shape with the target's vocabulary (a draft model
# must share it; llama.cpp allows at most 128 tokens of difference).
DRAFT_1B = replace(synth_gguf.SHAPES["llama-1b"], name="draft-1b", n_vocab=152064,
                   tied_embeddings=False)


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    return synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")


@pytest.fixture(scope="module")
def shapes(headers):
    return {name: read_shape(path) for name, path in headers.items()}


@pytest.fixture(scope="module")
def draft_1b(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft") / "draft-1b.gguf"
    return read_shape(synth_gguf.write_gguf(path, DRAFT_1B, "Q4_0", "sparse"))


def card(name: str):
    return load_card(name).with_host(**HOST)


def test_checking_cost_matches_the_h200_measurements(shapes):
    """llama-bench ppB on the H200, dense-27b: a pass of 4 cost 1.26x a pass of 1 with every
    block on the GPU (about 1.3x for 5, the brief's figure) and 2.5x with 24 of 66 blocks on
    the CPU, where compute grows with every token."""
    costs = model_costs(shapes["dense-27b"])
    h200 = load_card("h200").with_host(**H200_HOST)
    settings = ContextSettings(4096, n_ubatch=512)
    all_gpu = checking_terms(costs, Placement(67), settings, h200, 16, 0)
    assert 1.2 <= all_gpu.ratio(4) <= 1.35 and 1.25 <= all_gpu.ratio(5) <= 1.4
    assert all_gpu.ratio(16) < 2.5  # bandwidth-bound: far from linear
    third_on_cpu = checking_terms(costs, Placement(43), settings, h200, 16, 0)
    assert 2.2 <= third_on_cpu.ratio(4) <= 2.9
    assert third_on_cpu.ratio(16) > 6  # compute-bound: nearly linear
    # The convenience function is the same pass.
    assert checking_cost(costs, Placement(43), settings, h200, 0, 4, 16) == \
        pytest.approx(third_on_cpu.seconds(4))


def test_expected_tokens_per_pass():
    assert speculation.expected_tokens(0.0, 4) == 1.0  # nothing accepted: the pass's own token
    assert speculation.expected_tokens(0.7, 3) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert speculation.expected_tokens(1.0, 3) == 4.0


def test_qwen35_on_a_24gb_card_plans_mtp_with_every_block_on_the_gpu(shapes):
    shape, c = shapes["qwen35-27b"], card("rtx3090")
    plan = tune(shape, c, Request(n_ctx=4096))
    assert plan.speculative == "mtp" and plan.draft_n_max in speculation.DRAFT_LENGTHS
    assert plan.n_gpu_layers == shape.n_layer + 1 and not plan.tensor_overrides
    assert plan.predicted_decode_tps >= plan.predicted_plain_decode_tps * 1.05
    line = next(r for r in plan.reasons if r.startswith("speculation: mtp"))
    assert "checking" in line and "0.70 acceptance (assumed)" in line
    # The NextN block's weights are loaded on the GPU beside the trunk (a plan without MTP
    # skips them), and its own KV layer is counted.
    plain = tune(shape, c, Request(n_ctx=4096, speculation=False))
    assert plain.speculative == "off"
    nextn = sum(t.n_bytes for t in shape.tensors if t.layer == shape.n_layer_main)
    gpu, gpu_plain = plan.memory[0], plain.memory[0]
    assert gpu.weights - gpu_plain.weights == nextn
    assert gpu.kv > gpu_plain.kv and gpu.total <= vram_budget(c, 512 * MIB)


def test_speculation_may_buy_every_block_on_the_gpu_with_a_smaller_kv_type(shapes):
    """qwen35-27b at 131072 on 24 GiB: plain decode keeps f16 KV; the NextN block and its KV
    do not fit beside it, and q8_0 KV with MTP beats f16 without. Both compete in one search,
    and the reasons say what drafting changed."""
    shape, c = shapes["qwen35-27b"], card("rtx3090")
    plain = tune(shape, c, Request(n_ctx=131072, speculation=False))
    plan = tune(shape, c, Request(n_ctx=131072))
    assert plain.type_k == "f16" and plain.n_gpu_layers == shape.n_layer + 1
    assert plan.speculative == "mtp" and plan.type_k == "q8_0"
    assert plan.n_gpu_layers == shape.n_layer + 1 and not plan.tensor_overrides
    assert plan.predicted_decode_tps >= plain.predicted_decode_tps * 1.05
    assert any("without it the search would choose" in r and "f16 KV" in r for r in plan.reasons)


def test_measured_low_acceptance_turns_mtp_off(shapes):
    plan = tune(shapes["qwen35-27b"], card("rtx3090"),
                Request(n_ctx=4096, acceptance={"mtp": 0.05}))
    assert plan.speculative == "off" and plan.draft_n_max == 0
    assert any(r.startswith("speculation off: mtp") and "(measured)" in r for r in plan.reasons)


def test_many_blocks_on_the_cpu_turn_speculation_off_and_say_why(shapes):
    """12 GiB for a 27B model: a third or more of the blocks are read on the CPU, a checking
    pass costs several plain ones, and drafting would lose."""
    qwen = tune(shapes["qwen35-27b"], card("rtx3060-12g"), Request(n_ctx=4096))
    assert qwen.speculative == "off"
    assert any(r.startswith("speculation off: mtp") for r in qwen.reasons)
    dense = tune(shapes["dense-27b"], card("rtx3060-12g"), Request(n_ctx=32768))
    assert dense.speculative == "off"
    why = next(r for r in dense.reasons if r.startswith("speculation off: lookup"))
    ratio = float(why.split("costs ")[1].split("x")[0])
    assert ratio >= 2.0 and "blocks read on the CPU" in why


def test_moe_checking_pass_reads_the_union_of_its_tokens_experts(shapes):
    """qwen35-35b-a3b on the H200's profile: with every expert on the GPU a checking pass of 2
    costs little more than one; with the experts in RAM it reads the union of both tokens'
    experts (each routes to its own 8 of 256) from host memory, nearly twice one token's
    expert read there, and what MTP gains shrinks. Where host memory is slow (25 GB/s, a
    laptop's), the experts' reads dominate a pass and drafting no longer pays (users report
    MTP at 11.2 tok/s against 19.6 plain with experts in RAM)."""
    shape = shapes["qwen35-35b-a3b"]
    costs = model_costs(shape)
    settings = ContextSettings(4096, n_ubatch=512)
    on_gpu = Placement(shape.n_layer + 1)
    in_ram = Placement(shape.n_layer + 1, n_cpu_expert_layers=shape.n_layer_main)
    h200 = load_card("h200").with_host(**H200_HOST)
    gpu_terms = checking_terms(costs, on_gpu, settings, h200, 16, 512)
    ram_terms = checking_terms(costs, in_ram, settings, h200, 16, 512)
    assert gpu_terms.ratio(2) < 1.2 and ram_terms.ratio(2) > 1.45
    f = costs.expert_active_fraction
    one_token = sum(b * f for b, _ in ram_terms.cpu_expert_bytes) / ram_terms.host_bandwidth
    extra = ram_terms.seconds(2) - ram_terms.seconds(1)
    assert extra >= one_token * (1 - f)  # the second token's own experts, read on the CPU
    mtp = next(s for s in speculation.speculators(shape, costs, h200)[0] if s.mode == "mtp")
    _, fast = speculation.speculative_speed(mtp, costs, on_gpu, settings, h200, 16, 512)
    _, slow = speculation.speculative_speed(mtp, costs, in_ram, settings, h200, 16, 512)
    assert fast.pays and slow.gain < fast.gain - 0.05
    laptop = load_card("rtx4060").with_host(ram_bytes=64 * GIB, cores=8, host_bandwidth_gbs=25)
    mtp = next(s for s in speculation.speculators(shape, costs, laptop)[0] if s.mode == "mtp")
    _, gpu_choice = speculation.speculative_speed(mtp, costs, on_gpu, settings, laptop, 8, 512)
    _, ram_choice = speculation.speculative_speed(mtp, costs, in_ram, settings, laptop, 8, 512)
    assert gpu_choice.pays and not ram_choice.pays
    assert speculation.cpu_blocks(costs, in_ram, h200) == shape.n_layer_main
    assert speculation.cpu_blocks(costs, on_gpu, h200) == 0


def test_moe_tuner_prices_a_check_by_the_experts_it_reads_on_the_cpu(shapes):
    """The tuner on card profiles: 12 GiB keeps half the experts of qwen35-35b-a3b in RAM, and
    MTP's check of 2 tokens reads up to twice their experts there: priced so (1.4x one step,
    where a check on the GPU alone costs about one), it still pays at the assumed acceptance
    and the reason says how many blocks a check reads on the CPU; 24 GiB holds every expert
    and plans MTP."""
    shape = shapes["qwen35-35b-a3b"]
    small = tune(shape, card("rtx3060-12g"), Request(n_ctx=4096))
    assert small.speculative == "mtp" and small.tensor_overrides
    why = next(r for r in small.reasons if r.startswith("speculation: mtp"))
    check = re.search(r"checking 2 tokens costs ([\d.]+)x one on this placement \(with (\d+) "
                      r"blocks read on the CPU\)", why)
    assert check and float(check.group(1)) > 1.2 and int(check.group(2)) > 0, why
    assert small.predicted_decode_tps >= small.predicted_plain_decode_tps * 1.05
    large = tune(shape, card("rtx4090"), Request(n_ctx=4096))
    assert large.speculative == "mtp" and not large.tensor_overrides
    assert large.predicted_decode_tps >= large.predicted_plain_decode_tps * 1.05


def test_lookup_only_where_checking_is_nearly_free(shapes):
    """At 0.3 acceptance lookup pays with every block on the GPU and nowhere else."""
    roomy = tune(shapes["dense-27b"], card("rtx3090"), Request(n_ctx=4096))
    tight = tune(shapes["dense-27b"], card("rtx4060"), Request(n_ctx=4096))
    assert roomy.speculative == "lookup" and roomy.n_gpu_layers == shapes["dense-27b"].n_layer + 1
    assert tight.speculative == "off"


@pytest.mark.parametrize("name", [n for n, c in synth_gguf.SHAPES.items() if not c.n_nextn])
def test_shapes_without_nextn_never_plan_mtp(shapes, name):
    assert shapes[name].n_nextn == 0
    for card_name in ("rtx3060-12g", "rtx3090", "a100-80g"):
        assert tune(shapes[name], card(card_name), Request(n_ctx=4096)).speculative != "mtp"


def test_recurrent_models_never_plan_lookup_or_draft(shapes):
    """Gated DeltaNet state is taken back past a rejected draft only from llama.cpp's snapshots,
    one per draft position: even with a draft model offered, qwen35 drafts only by MTP (short
    drafts), and says why the others are left out."""
    shape = shapes["qwen35-27b"]
    for card_name in CARDS:
        plan = tune(shape, card(card_name), Request(n_ctx=4096), draft=shape)
        assert plan.speculative in ("off", "mtp"), card_name
        assert any("recurrent state is taken back" in r and "not planned" in r
                   for r in plan.reasons)


def test_draft_model_is_placed_within_the_budget(shapes, draft_1b):
    shape, c = shapes["dense-27b"], card("rtx3090")
    plan = tune(shape, c, Request(n_ctx=4096), draft=draft_1b)
    assert plan.speculative == "draft" and plan.draft_n_gpu_layers == draft_1b.n_layer + 1
    assert plan.predicted_decode_tps >= plan.predicted_plain_decode_tps * 1.05
    # VRAM = the target's placement + every draft tensor but its token table (llama.cpp keeps
    # that on the CPU), and the draft's KV: its layers x n_ctx cells of the plan's KV type.
    target = memory_by_device(model_costs(shape), placement_of(plan, shape), settings_of(plan), c)
    draft_gpu = sum(t.n_bytes for t in draft_1b.tensors if t.name != "token_embd.weight")
    config = DRAFT_1B
    row = config.n_head_kv * config.head_dim * 2  # f16 K or V row
    assert plan.type_k == "f16"
    draft_kv = config.n_layer * 4096 * row * 2
    assert plan.memory[0].weights == target[0].weights + draft_gpu
    assert plan.memory[0].kv == target[0].kv + draft_kv
    assert plan.memory[0].total <= vram_budget(c, 512 * MIB)
    assert any(r.startswith("speculation: draft") and "draft-1b" in r for r in plan.reasons)


@pytest.mark.parametrize("ctx", (4096, 32768, 131072))
def test_plans_with_a_drafter_never_exceed_the_budget(shapes, draft_1b, ctx):
    """Every card, both drafting models, slots on auto: the drafter's memory never pushes a
    device past its budget."""
    cases = [("dense-27b", draft_1b), ("llama-8b", None), ("qwen35-27b", None)]
    for name, draft in cases:
        for card_name in CARDS:
            c = card(card_name)
            plan = tune(shapes[name], c, Request(n_ctx=ctx, num_parallel=None), draft=draft)
            for m in plan.memory:
                limit = ram_budget(c) if m.device == "CPU" else vram_budget(c, 512 * MIB)
                assert m.total <= limit, (name, card_name, m)
            assert plan.speculative in ("off", "lookup", "mtp", "draft")
            assert (plan.draft_n_max > 0) == (plan.speculative != "off")


def test_a_draft_with_another_vocabulary_is_not_used(shapes):
    plan = tune(shapes["dense-27b"], card("rtx3090"), Request(n_ctx=4096),
                draft=shapes["llama-1b"])
    assert plan.speculative != "draft"
    assert any("not used: its vocabulary" in r for r in plan.reasons)


def test_profiles_read_prompt_lookup_as_lookup_and_keep_draft_layers(home):
    plan = Plan(n_ctx=4096, speculative="draft", draft_n_max=4, draft_n_gpu_layers=17)
    path = save_profile(plan, "m", "rtx3090", 1)
    loaded = find_profile("m", "rtx3090")
    assert loaded.plan.load_key() == plan.load_key()
    assert loaded.plan.load_key() != replace(plan, draft_n_gpu_layers=0).load_key()
    path.write_text(path.read_text().replace('speculative = "draft"',
                                             'speculative = "prompt-lookup"'))
    assert find_profile("m", "rtx3090").plan.speculative == "lookup"
    assert Plan.from_dict({"n_ctx": 4096, "speculative": "prompt-lookup"}).speculative == "lookup"
    path.write_text(path.read_text().replace('speculative = "prompt-lookup"',
                                             'speculative = "eagle"'))
    with pytest.raises(ProfileError, match="plan.speculative"):
        find_profile("m", "rtx3090")
    assert profile_path("m", "rtx3090") == path


def test_tune_prints_the_speculation_line(home, headers, capsys):
    path = headers["qwen35-27b"]
    assert main(["tune", str(path), "--card", "rtx3090", "--ctx", "4096", "--no-save"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("speculation: mtp"))
    assert "with it" in line and "without" in line
    assert "  - speculation: mtp, drafts up to" in out  # the reason, under why:
