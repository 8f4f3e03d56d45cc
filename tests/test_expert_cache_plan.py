"""Issue 40, the expert cache in the plan: the pool's bytes from the model's shape (checked
against what the patched engine allocates), the VRAM the tuner keeps out of the placement for
it on a card profile, why it is off where it is, the setting, saved profiles, and the runner's
side of the switch (only the target context gets a pool). Real tuner searches over synthetic
GGUF headers (scripts/synth_gguf.py, `sparse`: the real tensor table, no weights), real
llama.cpp for the pool's size, the real `localllm tune` command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from scripts import synth_gguf

from daemon_process import isolated_env
from localllm.config import ConfigError, coerce, load_config
from localllm.engine import expert_cache
from localllm.engine.params import expert_cache_settings, model_params
from localllm.modelstore.shape import read_shape
from localllm.planner.card import GIB, load_card
from localllm.planner.costs import model_costs
from localllm.planner.expert_pool import (
    AUTO_SLOTS,
    AUTO_VRAM_SHARES,
    PRIOR_HITS,
    SWAPS_PER_STEP,
    blocks_in_ram,
    hit_curve,
    pool_shape,
    swaps_per_step,
)
from localllm.planner.memory import memory_by_device
from localllm.planner.plan import Plan
from localllm.planner.search import Request
from localllm.planner.tuner import tune
from localllm.profiles.choose import placement_of, settings_of
from localllm.profiles.saved import ProfileError, load_profile, save_profile

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def headers(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("headers")
    return {name: synth_gguf.write_gguf(d / f"{name}.gguf", synth_gguf.SHAPES[name], "Q4_0",
                                        "sparse")
            for name in ("qwen3-30b-a3b", "llama-8b")}


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    tiny = synth_gguf.tiny(synth_gguf.SHAPES["qwen3-30b-a3b"])
    shape = dataclasses.replace(tiny, name="moe-cache", n_layer=4, n_expert=32, n_expert_used=4)
    return synth_gguf.write_gguf(tmp_path_factory.mktemp("tiny") / "moe.gguf", shape, "Q4_1",
                                 "noise", routing="zipf:1")


def test_the_pool_costs_what_the_engine_allocates(tiny_moe):
    """(slots + 1 zero slot) x one expert's up+gate+down, plus each block's map: the bytes the
    patched llama.cpp reports for its pool (in RAM, here)."""
    run = subprocess.run([sys.executable, "-m", "scripts.moe_cache_check",
                          str(tiny_moe), "--tokens", "4", "--slots", "8", "--pool-in-ram"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    engine = json.loads(run.stdout.splitlines()[-1])["stats"]
    pool = pool_shape(read_shape(tiny_moe))
    assert pool.blocks == (0, 1, 2, 3) and pool.n_expert == 32
    assert engine["slots"] == 8 and engine["pool_bytes"] == pool.bytes(8)
    assert pool.slots_in(pool.bytes(8)) == 8 and pool.slots_in(pool.bytes(8) - 1) == 7
    assert pool.slots_in(0) == 0


def test_the_tuner_keeps_the_pools_vram_out_of_the_placement(headers):
    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    without = tune(shape, card, Request())
    plan = tune(shape, card, Request(expert_cache=512))
    pool = pool_shape(shape)
    need = pool.bytes(512)
    assert 1.2 * GIB < need < 1.3 * GIB  # 512 x 2.5 MiB of Q4_0 up/gate/down (768 x 2048)
    assert plan.expert_cache == 512 and without.expert_cache == 0
    # the placement gets less VRAM: more blocks' experts stay in RAM, all served by the pool
    assert len(blocks_in_ram(plan, shape, pool)) > len(blocks_in_ram(without, shape, pool)) > 0
    # the plan's VRAM is the placement's, which fits what the pool leaves, and the pool's
    budget = card.free_vram_bytes - Request().margin_bytes
    placed = {m.device: m for m in memory_by_device(
        model_costs(shape), placement_of(plan, shape), settings_of(plan), card)}
    gpu = next(m for m in plan.memory if m.device == "CUDA0")
    assert gpu.weights == placed["CUDA0"].weights + need
    assert placed["CUDA0"].total <= budget - need < plan.vram_bytes() <= budget
    assert any("and 1.3 GiB for the expert cache's pool leaves" in r for r in plan.reasons)
    on = next(r for r in plan.reasons if r.startswith("expert cache on:"))
    assert "512 expert slots of 2.5 MiB on CUDA0 (1.3 GiB of VRAM kept out" in on
    # priced at the same context as the plan without a pool: its hits against no pool
    assert plan.n_ctx == without.n_ctx
    priced = next(r for r in plan.reasons if r.startswith("expert cache: expected hit rate"))
    assert "assumed from routing studies" in priced
    assert f"against {without.predicted_decode_tps:.1f} without" in priced
    assert plan.load_key() != dataclasses.replace(plan, expert_cache=0).load_key()


def test_a_dry_run_of_a_pooled_plan_counts_the_graph_the_pool_makes(headers):
    """A dry run has no pool (the engine makes none for a model without weights), so its GPU
    compute buffer is raised to the formula's bound for the pooled graph; the host's, and every
    figure of a plan without a pool or with the pool in RAM, stay as measured."""
    from localllm.profiles.dryrun import with_pool_bound

    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    plan = tune(shape, card, Request(expert_cache=512))
    costs, placement, settings = model_costs(shape), placement_of(plan, shape), settings_of(plan)
    measured = {"CUDA0": 16 << 20, "CPU": 50 << 20}
    raised = with_pool_bound(measured, plan, costs, placement, settings, card)
    bound = next(m.compute for m in memory_by_device(costs, placement, settings, card,
                                                     op_offload=False) if m.device == "CUDA0")
    copying = next(m.compute for m in memory_by_device(costs, placement, settings, card)
                   if m.device == "CUDA0")
    assert raised == {"CUDA0": bound, "CPU": 50 << 20}
    assert 16 << 20 < bound <= copying  # never the room for a block's copied experts
    for other in (replace(plan, expert_cache=0), replace(plan, expert_cache_device="cpu")):
        assert with_pool_bound(measured, other, costs, placement, settings, card) == measured
    larger = {"CUDA0": bound + (64 << 20), "CPU": 50 << 20}  # a measured figure above it stands
    assert with_pool_bound(larger, plan, costs, placement, settings, card) == larger


def test_a_hit_moves_an_experts_read_from_the_cpu_to_the_gpu(headers):
    """The speed model: the served blocks' routed experts found in the pool are read at the
    GPU's bandwidth, the rest at the host's; more hits, faster decode; none, slower (the
    second chains and the copies still cost)."""
    from localllm.planner.checking import checking_terms
    from localllm.planner.speed import ExpertPool, curve_at, predict_speed
    from localllm.profiles.choose import placement_of, settings_of

    assert curve_at(PRIOR_HITS, 0.25) == pytest.approx(0.67)
    assert curve_at(PRIOR_HITS, 0.375) == pytest.approx(0.74)
    assert curve_at(PRIOR_HITS, 0.0) == 0.0 and curve_at(PRIOR_HITS, 1.0) == 1.0
    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    plan = tune(shape, card, Request())
    costs, placement, settings = model_costs(shape), placement_of(plan, shape), settings_of(plan)
    blocks = frozenset(pool_shape(shape).blocks)

    def decode(curve) -> float:
        pool = ExpertPool(128 * 8, 128, blocks, curve, swap_bytes=0)
        return predict_speed(costs, placement, settings, card, pool=pool).decode_tps

    plain = predict_speed(costs, placement, settings, card).decode_tps
    assert decode(((0.25, 0.9),)) > decode(PRIOR_HITS) > plain > decode(((0.5, 0.0),))
    # a checking pass of speculative decoding (4 tokens) reads its union of experts from the
    # pool as decode does
    pool = ExpertPool(128 * 8, 128, blocks, PRIOR_HITS, swap_bytes=0)
    assert checking_terms(costs, placement, settings, card, pool=pool).seconds(4) < \
        checking_terms(costs, placement, settings, card).seconds(4)


def test_auto_sizes_the_pool_and_turns_it_off_where_measured_hits_do_not_pay(headers):
    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    without = tune(shape, card, Request())
    skewed = tune(shape, card, Request(expert_cache=AUTO_SLOTS,
                                       measured_hits=((0.2, 0.75, 0.5),)))
    # a whole number of experts a block, or the most that fit in the share of VRAM auto uses
    pool = pool_shape(shape)
    budget = card.gpu_list[0].free_vram_bytes - Request().margin_bytes
    room = budget * max(AUTO_VRAM_SHARES)
    slots = skewed.expert_cache
    assert slots > 0 and (slots % 128 == 0 or any(slots == pool.slots_in(int(budget * share))
                                                  for share in AUTO_VRAM_SHARES))
    assert pool.bytes(slots) <= room
    assert skewed.n_ctx == without.n_ctx
    assert 0 < skewed.expected_hit_rate <= 1 and without.expected_hit_rate == 0
    # the plan says how many experts the pool takes in a step: more for a bigger pool
    assert skewed.expert_cache_swaps == swaps_per_step(slots) >= SWAPS_PER_STEP
    assert any(f"taking in up to {skewed.expert_cache_swaps} a step" in r for r in skewed.reasons)
    assert skewed.predicted_decode_tps > without.predicted_decode_tps
    priced = next(r for r in skewed.reasons if r.startswith("expert cache: expected hit"))
    assert "from this model's hits measured while serving" in priced
    # uniform routing, as measured: the pool's VRAM is worth more as experts on the GPU
    uniform = tune(shape, card, Request(expert_cache=AUTO_SLOTS,
                                        measured_hits=((0.1, 0.05, 3.5),)))
    assert uniform.expert_cache == 0
    assert uniform.predicted_decode_tps == without.predicted_decode_tps
    off = next(r for r in uniform.reasons if r.startswith("expert cache off:"))
    assert "does not pay" in off and "expected hit rate" in off
    # a measured share replaces the prior there, and scales it elsewhere
    curve = hit_curve(((0.125, 0.2, 1.0),))
    assert (0.125, 0.2) in curve
    assert dict(curve)[0.5] < dict(PRIOR_HITS)[0.5]


def test_measured_hits_are_kept_per_model_file(tmp_path):
    from localllm.profiles.expert_hits import MIN_LOOKUPS, measured_hits, record

    path = tmp_path / "expert_hits.toml"
    record("moe", 100, 0.125, 30_000, 10_000, 500, 1000, path=path)
    assert measured_hits("moe", 100, path) == ((0.125, 0.75, 0.5),)
    assert "evictions = 500" in path.read_text()
    assert measured_hits("moe", 101, path) == ()  # another file of that name
    record("moe", 100, 0.125, 10, 5, 1, 2, path=path)  # a new load's first answer
    assert measured_hits("moe", 100, path) == ((0.125, 0.75, 0.5),)
    record("moe", 100, 0.25, MIN_LOOKUPS - 1, 0, 0, 1, path=path)  # too few to count
    assert len(measured_hits("moe", 100, path)) == 1


def test_tune_on_a_card_profile_reads_the_setting(headers, tmp_path):
    env = isolated_env(tmp_path, LOCALLLM_EXPERT_CACHE="256")
    result = subprocess.run([sys.executable, "-m", "localllm.cli", "tune",
                             str(headers["qwen3-30b-a3b"]), "--card", "rtx3060-12g", "--json",
                             "--no-save"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["expert_cache"] == 256
    assert any(r.startswith("expert cache on: 256 expert slots") for r in plan["reasons"])
    # auto, from the prior curve: the pool priced faster than no pool by more than the
    # margin an assumed hit rate must win by (ASSUMED_HITS_MARGIN) is on, priced at the prior
    env["LOCALLLM_EXPERT_CACHE"] = "auto"
    result = subprocess.run([sys.executable, "-m", "localllm.cli", "tune",
                             str(headers["qwen3-30b-a3b"]), "--card", "rtx3060-12g", "--json",
                             "--no-save"], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert plan["expert_cache"] > 0
    assert any("assumed from routing studies" in r for r in plan["reasons"])


def test_a_dense_model_is_refused_with_a_reason_not_an_error(headers):
    plan = tune(read_shape(headers["llama-8b"]), load_card("rtx3060-12g"),
                Request(expert_cache=16))
    assert plan.expert_cache == 0
    assert any(r.startswith("expert cache off:") and "dense model" in r for r in plan.reasons)


def test_no_pool_where_every_expert_fits_on_the_gpu_or_there_is_no_gpu(headers):
    shape = read_shape(headers["qwen3-30b-a3b"])
    roomy = tune(shape, load_card("h200"), Request(expert_cache=64))
    assert roomy.expert_cache == 0
    assert any("every expert on the GPU" in r for r in roomy.reasons)
    cpu = load_card("cpu-only")
    bare = tune(shape, cpu, Request(expert_cache=64))
    assert bare.expert_cache == 0 and any("no GPU to hold the pool" in r
                                                for r in bare.reasons)
    in_ram = tune(shape, cpu, Request(expert_cache=64, expert_cache_device="cpu"))
    assert in_ram.expert_cache == 64
    ram = next(m for m in in_ram.memory if m.device == "CPU")
    assert ram.weights == next(m for m in bare.memory if m.device == "CPU").weights \
        + pool_shape(shape).bytes(64)


def test_the_setting_and_saved_profiles(tmp_path):
    assert coerce("expert_cache", "off") == "off" and coerce("expert_cache", "16") == 16
    assert coerce("expert_cache", "Auto") == "auto"
    with pytest.raises(ConfigError, match="whole number or off or auto"):
        coerce("expert_cache", "lots")
    assert load_config(tmp_path / "none.toml", {}).expert_cache == "auto"  # the default
    with pytest.raises(ConfigError, match="at least 0"):
        load_config(tmp_path / "none.toml", {"LOCALLLM_EXPERT_CACHE": "-3"})
    path = save_profile(Plan(n_ctx=4096, expert_cache=16), "moe", "rtx3060-12g", 1,
                        directory=tmp_path)
    assert "expert_cache = 16" in path.read_text()
    assert load_profile(path).plan.expert_cache == 16
    path.write_text(path.read_text().replace("expert_cache = 16",
                                             "expert_cache = -1"))
    with pytest.raises(ProfileError, match="expert_cache must be 0 or more"):
        load_profile(path)


def test_a_profile_saved_under_the_old_name_still_loads(tmp_path):
    """Profiles written before the pool's one name (`expert_cache_slots` under [plan]) load
    with their pool; saved again, they carry the one name only; where a hand edit left both,
    the one name's value counts."""
    path = save_profile(Plan(n_ctx=4096, expert_cache=16), "moe", "rtx3060-12g", 1,
                        directory=tmp_path)
    old = path.read_text().replace("expert_cache = 16", "expert_cache_slots = 24")
    assert "expert_cache_slots = 24" in old and "expert_cache =" not in old
    path.write_text(old)
    plan = load_profile(path).plan
    assert plan.expert_cache == 24
    again = save_profile(plan, "moe", "rtx3060-12g", 1, directory=tmp_path).read_text()
    assert "expert_cache = 24" in again and "expert_cache_slots" not in again
    path.write_text(again.replace("expert_cache = 24", "expert_cache = 8\nexpert_cache_slots = 24"))
    assert load_profile(path).plan.expert_cache == 8


def test_the_pool_in_ram_is_a_setting_that_reaches_the_plan(tiny_moe, tmp_path):
    """expert_cache_device = cpu: the pool in RAM (tests without a GPU), carried by the plan to
    the engine's settings; a word it does not know is refused, naming the choices."""
    from localllm.profiles.choose import config_request

    config = load_config(tmp_path / "none.toml", {"LOCALLLM_EXPERT_CACHE_DEVICE": "cpu",
                                                  "LOCALLLM_EXPERT_CACHE": "8"})
    request = config_request(config=config)
    assert request.expert_cache_device == "cpu" and request.expert_cache == 8
    gpu = config_request(config=replace(config, expert_cache_device="gpu"))
    assert gpu.expert_cache_device == "gpu"
    with pytest.raises(ConfigError, match="expert_cache_device must be one of gpu, cpu"):
        load_config(tmp_path / "none.toml", {"LOCALLLM_EXPERT_CACHE_DEVICE": "disk"})
    shape = read_shape(tiny_moe)
    plan = tune(shape, load_card("cpu-only"), replace(request, n_ctx=1024))
    assert plan.expert_cache == 8 and plan.expert_cache_device == "cpu"
    assert expert_cache_settings(plan) == expert_cache.Settings(expert_cache=8,
                                                                expert_cache_device="cpu")


def test_the_plan_is_the_target_contexts_pool():
    """The engine's settings come from the plan alone (engine/params.py; tests/test_expert_cache.py
    shows the engine taking them): no pool without slots."""
    assert expert_cache_settings(Plan(n_ctx=4096)) is None
    assert expert_cache_settings(Plan(n_ctx=4096, expert_cache=16)) == \
        expert_cache.Settings(expert_cache=16)
    # the pool is filled from the experts' bytes in RAM: no repacking for the CPU's kernels
    assert model_params(Plan(n_ctx=4096, expert_cache=16))[0].use_extra_bufts is False
    assert model_params(Plan(n_ctx=4096))[0].use_extra_bufts is True


def test_only_an_auto_pool_far_from_its_price_is_planned_again():
    """The scheduler's rule (localllm/profiles/expert_hits.py): `auto`, MIN_LOOKUPS lookups, and a
    measured rate REPLAN_HIT_GAP or more from the plan's, either way."""
    from types import SimpleNamespace

    from localllm.profiles.expert_hits import (
        MIN_LOOKUPS,
        REPLAN_HIT_GAP,
        pool_far_from_its_price,
    )

    plan = Plan(n_ctx=8192, expert_cache=1024, expected_hit_rate=0.68)

    def pool(rate: float, lookups: int = MIN_LOOKUPS):
        return SimpleNamespace(hits=round(rate * lookups), misses=lookups - round(rate * lookups))

    assert pool_far_from_its_price(pool(0.30), plan, "auto") == (
        f"its expert cache hit 30% of {MIN_LOOKUPS} lookups where the plan assumed 68%")
    assert pool_far_from_its_price(pool(0.95), plan, "auto")  # better than priced: too
    assert not pool_far_from_its_price(pool(0.68 - REPLAN_HIT_GAP + 0.01), plan, "auto")
    assert not pool_far_from_its_price(pool(0.30, MIN_LOOKUPS - 1), plan, "auto")
    assert not pool_far_from_its_price(pool(0.30), plan, 1024)  # the user's own size
    assert not pool_far_from_its_price(None, plan, "auto")


def test_misses_on_the_gpu_trade_the_crossings_for_pcie_reads(headers):
    """patches/0003: with expert_misses_on_gpu the served blocks' misses are read by the GPU
    from pinned RAM over PCIe (speed.MAPPED_READ_FRACTION of the card's pcie_gbs), and their two
    crossings a block go. Where the pool hits most, that is faster; where it misses most, the
    PCIe reads cost more than the host's. Checking passes price the misses the same way."""
    from localllm.planner.checking import checking_terms
    from localllm.planner.speed import ExpertPool, predict_speed

    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    plan = tune(shape, card, Request())
    costs, placement, settings = model_costs(shape), placement_of(plan, shape), settings_of(plan)
    blocks = frozenset(pool_shape(shape).blocks)

    def decode(curve, on_gpu: bool) -> float:
        pool = ExpertPool(128 * 8, 128, blocks, curve, misses_on_gpu=on_gpu)
        return predict_speed(costs, placement, settings, card, pool=pool).decode_tps

    assert decode(((0.25, 0.95),), True) > decode(((0.25, 0.95),), False)
    assert decode(((0.5, 0.0),), True) < decode(((0.5, 0.0),), False)
    mapped = ExpertPool(128 * 8, 128, blocks, ((0.25, 0.95),), misses_on_gpu=True)
    cpu = dataclasses.replace(mapped, misses_on_gpu=False)
    assert checking_terms(costs, placement, settings, card, pool=mapped).mapped_expert_bytes
    assert not checking_terms(costs, placement, settings, card, pool=cpu).mapped_expert_bytes


def test_the_expert_misses_setting_picks_who_computes_them(headers, tmp_path):
    """`expert_misses`: cpu and gpu are kept as asked; auto prices both and keeps the faster,
    and the plan says so. Past RAM (pageable pages) the GPU cannot read them in place."""
    from localllm.planner.expert_pool import misses_can_go_to_gpu

    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    hits = ((0.2, 0.9, 0.5),)
    plans = {setting: tune(shape, card, Request(expert_cache=AUTO_SLOTS,
                                                measured_hits=hits, expert_misses=setting))
             for setting in ("cpu", "gpu", "auto")}
    assert plans["cpu"].expert_misses_on_gpu is False
    assert plans["gpu"].expert_misses_on_gpu is True
    assert plans["gpu"].pin_in_place
    assert any("misses read by the GPU" in r for r in plans["gpu"].reasons)
    assert not any("misses read by the GPU" in r for r in plans["cpu"].reasons)
    faster = max(plans["cpu"], plans["gpu"], key=lambda p: (-p.predicted_session_s,
                                                            p.predicted_decode_tps))
    assert plans["auto"].expert_misses_on_gpu == faster.expert_misses_on_gpu
    assert plans["auto"].predicted_session_s == faster.predicted_session_s
    assert plans["gpu"].load_key() != plans["cpu"].load_key() or \
        plans["gpu"].expert_cache != plans["cpu"].expert_cache
    assert misses_can_go_to_gpu(Plan(n_ctx=4096, pin_in_place=True))
    assert misses_can_go_to_gpu(Plan(n_ctx=4096, use_mmap=False))
    assert not misses_can_go_to_gpu(Plan(n_ctx=4096, streamed_bytes=1 << 30))
    # the setting
    assert load_config(tmp_path / "none.toml", {"LOCALLLM_EXPERT_MISSES": "gpu"}) \
        .expert_misses == "gpu"
    with pytest.raises(ConfigError, match="expert_misses must be one of auto, cpu, gpu"):
        load_config(tmp_path / "none.toml", {"LOCALLLM_EXPERT_MISSES": "disk"})


def test_the_runner_asks_the_engine_for_misses_on_the_gpu(tmp_path):
    plan = Plan(n_ctx=4096, expert_cache=16, expert_misses_on_gpu=True)
    assert expert_cache_settings(plan) == expert_cache.Settings(expert_cache=16,
                                                                expert_misses_on_gpu=True)
    # no pool, nothing to ask
    assert expert_cache_settings(replace(plan, expert_cache=0)) is None
    # a saved profile keeps and edits the choice
    path = save_profile(Plan(n_ctx=4096, expert_cache=16, expert_misses_on_gpu=True),
                        "moe", "rtx3060-12g", 1, directory=tmp_path)
    assert "expert_misses_on_gpu = true" in path.read_text()
    assert load_profile(path).plan.expert_misses_on_gpu is True


def test_a_bigger_pool_takes_in_more_experts_a_step_and_the_runner_says_so(tmp_path):
    assert swaps_per_step(0) == swaps_per_step(2048) == SWAPS_PER_STEP
    assert swaps_per_step(4322) == 8 and swaps_per_step(5043) == 9
    pool = Plan(n_ctx=4096, expert_cache=5043, expert_cache_swaps=9)
    assert expert_cache_settings(pool) == expert_cache.Settings(expert_cache=5043,
                                                                expert_cache_swaps=9)
    assert expert_cache_settings(replace(pool, expert_cache=0)) is None
    # a saved profile keeps and edits it, and refuses a negative count
    plan = Plan(n_ctx=4096, expert_cache=5043, expert_cache_swaps=9)
    assert plan.load_key() != replace(plan, expert_cache_swaps=4).load_key()
    path = save_profile(plan, "moe", "rtx3060-12g", 1, directory=tmp_path)
    assert "expert_cache_swaps = 9" in path.read_text()
    assert load_profile(path).plan.expert_cache_swaps == 9
    path.write_text(path.read_text().replace("expert_cache_swaps = 9", "expert_cache_swaps = -2"))
    with pytest.raises(ProfileError, match="expert_cache_swaps must be 0 or more"):
        load_profile(path)


def test_the_running_plan_is_priced_again_at_its_pools_measured_hits(headers):
    """/api/stats' expert_cache.predicted_decode_by_depth (decode_at_measured_hits): the same
    placement with the pool's measured hit rate in place of the one it was priced with."""
    from localllm.daemon.api.stats import expert_cache_report
    from localllm.engine.expert_cache import ExpertCacheStats
    from localllm.profiles.expert_hits import MIN_LOOKUPS, evicted
    from localllm.profiles.pool_price import decode_at_measured_hits

    shape, card = read_shape(headers["qwen3-30b-a3b"]), load_card("rtx3060-12g")
    plan = tune(shape, card, Request(expert_cache=AUTO_SLOTS,
                                     measured_hits=((0.2, 0.75, 0.5),)))
    assert plan.expert_cache > 0 and plan.speculative == "off"
    layers = len(blocks_in_ram(plan, shape, pool_shape(shape)))

    def figures(rate: float, lookups: int = 10 * MIN_LOOKUPS) -> ExpertCacheStats:
        hits = round(rate * lookups)
        return ExpertCacheStats(slots=plan.expert_cache, layers=layers, hits=hits,
                                misses=lookups - hits, swaps=500, steps=1000, pool_bytes=0,
                                misses_on_gpu=int(plan.expert_misses_on_gpu))

    # at the rate the plan was priced with: the plan's own curve
    same = decode_at_measured_hits(plan, shape, card, figures(plan.expected_hit_rate))
    assert [d for d, _ in same] == [d for d, _ in plan.predicted_decode_by_depth]
    for (_, priced), (_, again) in zip(plan.predicted_decode_by_depth, same, strict=True):
        assert again == pytest.approx(priced, rel=0.01)
    # more hits than priced: faster at every depth; fewer: slower
    better = decode_at_measured_hits(plan, shape, card, figures(plan.expected_hit_rate + 0.1))
    worse = decode_at_measured_hits(plan, shape, card, figures(plan.expected_hit_rate - 0.2))
    assert all(w < s < b for (_, w), (_, s), (_, b) in zip(worse, same, better, strict=True))
    # not known yet, or not priced this way
    assert decode_at_measured_hits(plan, shape, card, figures(0.9, MIN_LOOKUPS - 1)) == ()
    assert decode_at_measured_hits(plan, shape, card, None) == ()
    drafting = replace(plan, speculative="mtp")
    assert decode_at_measured_hits(drafting, shape, card, figures(0.9)) == ()
    # a step's copies are the swaps past the pool's first fill (every slot filled once)
    filling = replace(figures(0.9), swaps=plan.expert_cache + 10 * 1000)
    assert evicted(filling) == 10 * 1000 and evicted(figures(0.9)) == max(
        0, 500 - plan.expert_cache)
    copying = decode_at_measured_hits(plan, shape, card, filling)
    assert all(c < f for (_, c), (_, f) in zip(copying, decode_at_measured_hits(
        plan, shape, card, replace(filling, swaps=plan.expert_cache)), strict=True))
    # /api/stats' report carries it where known
    report = expert_cache_report(plan, figures(0.9), better)
    assert report["predicted_decode_by_depth"] == [list(p) for p in better]
    assert "predicted_decode_by_depth" not in expert_cache_report(plan, figures(0.9))
    # priced once per answer's figures, not on every poll of /api/stats
    import asyncio
    from types import SimpleNamespace

    from localllm.daemon.api.stats import decode_at_hits

    probes = []
    scheduler = SimpleNamespace(planner=SimpleNamespace(card=lambda: probes.append(1) or card))
    runner = SimpleNamespace(expert_cache=figures(0.9), running_plan=plan)
    slot = SimpleNamespace(runner=runner, shape=shape, priced_at_hits=())
    first = asyncio.run(decode_at_hits(scheduler, slot))
    assert first == decode_at_measured_hits(plan, shape, card, figures(0.9))
    assert asyncio.run(decode_at_hits(scheduler, slot)) == first and len(probes) == 1
    runner.expert_cache = figures(0.7)  # the next answer's figures
    assert asyncio.run(decode_at_hits(scheduler, slot)) != first and len(probes) == 2
