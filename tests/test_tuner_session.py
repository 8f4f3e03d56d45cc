"""Issue 21: the tuner plans for the whole session. RAM as it is at load time, prompt reading
priced per micro-batch (and the engine reading whole micro-batches), a workload in place of one
fill, recurrent-state snapshots counted, plans per fill band."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace

import pytest
from scripts import synth_gguf
from localllm.engine import hardware
from localllm.engine.runner.engine import CANCEL_BOUND_S, prompt_chunk
from localllm.modelstore.shape import read_shape
from localllm.planner.budgets import RAM_RESERVE, ram_budget
from localllm.planner.card import GIB, MIB, load_card
from localllm.planner.costs import model_costs
from localllm.planner.memory import ContextSettings, block_kv_bytes, memory_by_device
from localllm.planner.placements import Placement
from localllm.planner.plan import Plan
from localllm.planner.search import Request
from localllm.planner.speed import prompt_cost
from localllm.planner.tuner import tune
from localllm.planner.workload import AGENT, CHAT, from_fill
from localllm.profiles.bands import band_plans
from localllm.profiles.choose import config_request, placement_of, settings_of

from localllm.config import ConfigError, check_setting

H200_HOST = dict(ram_bytes=128 * GIB, cores=16, host_bandwidth_gbs=51.2)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return {name: read_shape(path) for name, path in paths.items()}


def h200(gib: float):
    return load_card("h200").with_host(**H200_HOST).with_vram(gib)


# ---- RAM as it really is -----------------------------------------------------------------------

def test_ram_is_memavailable_capped_by_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\n"
                       "MemAvailable:   100000000 kB\n")
    assert hardware.mem_available_bytes(str(meminfo)) == 100000000 * 1024
    # cgroup v2: /proc/self/cgroup names the group; its memory.max less what it holds (page
    # cache excepted) is the room, and a parent's tighter limit wins.
    proc = tmp_path / "cgroup"
    proc.write_text("0::/bench/daemon\n")
    root = tmp_path / "fs"
    (root / "bench" / "daemon").mkdir(parents=True)
    (root / "bench" / "daemon" / "memory.max").write_text("max\n")
    (root / "bench" / "memory.max").write_text(str(24 * GIB) + "\n")
    (root / "bench" / "memory.current").write_text(str(6 * GIB) + "\n")
    (root / "bench" / "memory.stat").write_text(f"anon {2 * GIB}\nfile {4 * GIB}\n")
    assert hardware.cgroup_room_bytes(str(proc), str(root)) == 22 * GIB
    (root / "bench" / "daemon" / "memory.max").write_text(str(10 * GIB) + "\n")
    assert hardware.cgroup_room_bytes(str(proc), str(root)) == 10 * GIB
    # No limit anywhere: no cap.
    (proc).write_text("0::/\n")
    assert hardware.cgroup_room_bytes(str(proc), str(root)) is None
    # cgroup v1's memory controller (a hybrid host: v2 mounted without it) is read the same
    # way, and its "unlimited" is no limit.
    proc.write_text("4:memory:/jobs/one\n1:cpu,cpuacct:/jobs/one\n0::/\n")
    v1 = root / "memory" / "jobs" / "one"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(8 * GIB) + "\n")
    (v1 / "memory.usage_in_bytes").write_text(str(5 * GIB) + "\n")
    (v1 / "memory.stat").write_text(f"cache {4 * GIB}\nrss {1 * GIB}\ntotal_cache {4 * GIB}\n")
    (root / "memory" / "jobs" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert hardware.cgroup_room_bytes(str(proc), str(root)) == 7 * GIB
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert hardware.cgroup_room_bytes(str(proc), str(root)) is None
    # This machine: a probe reads MemAvailable, never more than the physical RAM.
    assert 0 < hardware.ram_available() <= hardware.host_ram_bytes()
    assert hardware.probe_card().ram_available_bytes > 0


def test_plans_count_the_ram_available_and_past_it_read_from_disk(shapes):
    big = shapes["70b"]  # 37 GiB of weights
    card = h200(12)
    roomy = tune(big, replace(card, ram_available_bytes=100 * GIB), Request(n_ctx=8192))
    boxed = tune(big, replace(card, ram_available_bytes=24 * GIB), Request(n_ctx=8192))
    assert ram_budget(replace(card, ram_available_bytes=24 * GIB)) == 24 * GIB - RAM_RESERVE
    assert not any("read from disk per token" in r for r in roomy.reasons)
    [line] = [r for r in boxed.reasons if "read from disk per token" in r]
    gib_per_token = float(re.match(r"([\d.]+) GiB read from disk", line).group(1))
    cpu = next(m for m in boxed.memory if m.device == "CPU")
    assert gib_per_token == pytest.approx((cpu.total - (24 * GIB - RAM_RESERVE)) / GIB, abs=0.06)
    assert boxed.predicted_decode_tps < roomy.predicted_decode_tps / 3
    # The ram_budget setting wins over what the probe saw.
    set_budget = tune(big, replace(card, ram_available_bytes=100 * GIB),
                      Request(n_ctx=8192, ram_budget_bytes=24 * GIB))
    assert any("read from disk per token" in r for r in set_budget.reasons)


def test_ram_budget_setting(home, monkeypatch):
    check_setting("ram_budget", "24G")
    check_setting("ram_budget", "auto")
    for bad in ("lots", "12K"):
        with pytest.raises(ConfigError):
            check_setting("ram_budget", bad)
    (home / "xdg_config_home" / "localllm").mkdir(parents=True)
    (home / "xdg_config_home" / "localllm" / "config.toml").write_text('ram_budget = "20G"\n')
    assert config_request().ram_budget_bytes == 20 * GIB


# ---- prompt reading ----------------------------------------------------------------------------

def test_prompt_cost_from_pinned_memory_reproduces_llama_bench(shapes):
    """llama-bench pp16384 on the H200 (2026-12-02), Qwen3-30B-A3B Q4_0, q8_0 KV, the experts of
    24 blocks in RAM: loaded without mmap (pinned) 2223 tok/s at ubatch 512 and 5857 at 2048;
    mapped 438 and 1744."""
    costs = model_costs(shapes["qwen3-30b-a3b"])
    card = h200(141)
    placement = Placement(49, n_cpu_expert_layers=24)
    measured = {(True, 512): 2223, (True, 2048): 5857, (False, 512): 438, (False, 2048): 1744}
    for (pinned, ub), tps in measured.items():
        cost = prompt_cost(costs, placement, ContextSettings(32768, "q8_0", "q8_0", True, ub),
                           card, 16, pinned=pinned)
        assert 16384 / cost.seconds(16384, ub) == pytest.approx(tps, rel=0.2), (pinned, ub)


def test_prompt_cost_reproduces_llama_bench_by_micro_batch(shapes):
    """llama-bench pp4096 on the H200, dense-27b, q8_0 KV (device notes), the model mapped
    (llama.cpp's default load mode): the FFN of blocks 25-65 in RAM 258/425/835/1219 tok/s at
    ubatch 256/512/1024/2048; whole blocks (-ngl 40) 485 at 512 and 1398 at 2048."""
    costs = model_costs(shapes["dense-27b"])
    card = h200(141)
    measured = {Placement(67, n_cpu_ffn_layers=41): {256: 258, 512: 425, 1024: 835, 2048: 1219},
                Placement(40): {512: 485, 2048: 1398}}
    for placement, by_ub in measured.items():
        for ub, tps in by_ub.items():
            cost = prompt_cost(costs, placement, ContextSettings(8192, "q8_0", "q8_0", True, ub),
                               card, 16, pinned=False)
            assert 4096 / cost.seconds(4096, ub) == pytest.approx(tps, rel=0.12), (placement, ub)
    # Bigger micro-batches share the crossing: a 16K prompt reads 4x faster at 2048 than 256.
    ffn = Placement(67, n_cpu_ffn_layers=41)
    t = {ub: prompt_cost(costs, ffn, ContextSettings(32768, "q8_0", "q8_0", True, ub), card,
                         16, pinned=False).seconds(16384, ub) for ub in (256, 2048)}
    assert t[256] > 3.5 * t[2048]


def test_engine_reads_whole_micro_batches_within_the_cancel_bound():
    gpu = Plan(n_ctx=32768, n_gpu_layers=67, n_batch=2048, n_ubatch=1024,
               predicted_prefill_tps=835)
    assert prompt_chunk(gpu, 2048) == 1024  # one micro-batch: 1.2 s, never split
    fast = replace(gpu, n_ubatch=512, predicted_prefill_tps=1400)
    chunk = prompt_chunk(fast, 2048)
    assert chunk % 512 == 0 and chunk / 1400 <= CANCEL_BOUND_S
    on_cpu = Plan(n_ctx=4096, n_batch=512, n_ubatch=512, predicted_prefill_tps=400)
    assert prompt_chunk(on_cpu, 512) == 64  # a CPU: about a quarter second, no crossing


def test_plan_predicts_time_to_first_token_and_tune_shows_it(shapes, home):
    plan = tune(shapes["dense-27b"], h200(12), Request(n_ctx=32768, workload=AGENT))
    ttft = dict(plan.predicted_ttft)
    assert sorted(ttft) == [1024, 4096, 16384]
    assert ttft[1024] < ttft[4096] < ttft[16384]
    path = shapes["dense-27b"].path
    done = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", path, "--card", "h200",
                           "--vram", "12", "--ctx", "32768", "--workload", "agent"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert re.search(r"time to first token: 1K-token prompt [\d.]+ s, 4K-token prompt [\d.]+ s, "
                     r"16K-token prompt [\d.]+ s", done.stdout), done.stdout
    assert "session (agent:" in done.stdout
    assert re.search(r"up to 8192 \(chat\): .*\n.*up to 32768 \(agent\):", done.stdout), done.stdout
    bad = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", path, "--card", "h200",
                          "--workload", "nightly"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "workload" in bad.stderr


# ---- a workload in place of one fill -----------------------------------------------------------

def test_agent_workload_buys_prompt_speed_and_depth_where_chat_buys_the_start(shapes):
    """dense-27b at 32K on 12 GiB: an agent's 20K-token prompt and turns that grow to the end
    of the context want every block's attention on the GPU and big micro-batches; a chat
    stays shallow and keeps the small micro-batch's VRAM for weights. The reasons say which
    moment each choice serves."""
    shape = shapes["dense-27b"]
    card = h200(12)
    chat = tune(shape, card, Request(n_ctx=32768, margin_bytes=128 * MIB, workload=CHAT))
    agent = tune(shape, card, Request(n_ctx=32768, margin_bytes=128 * MIB, workload=AGENT))
    assert agent.n_ubatch >= chat.n_ubatch
    assert agent.n_gpu_layers == shape.n_layer + 1  # every block's attention on the GPU
    # From pinned memory the weights in RAM cross at PCIe speed (speed.py): the chat reads a
    # long prompt within a third of the agent's time (issue 36), the agent no slower: its
    # bigger micro-batch costs little VRAM since the logits are reserved for the rows that
    # ask for them, not for the whole micro-batch.
    ttft = dict(agent.predicted_ttft)[16384], dict(chat.predicted_ttft)[16384]
    assert ttft[0] <= ttft[1] * 1.05 and ttft[1] <= ttft[0] * 1.35, ttft
    assert agent.pin_in_place and chat.pin_in_place
    # Each plan is the better one for its own session.
    chat_depths, agent_depths = dict(chat.predicted_decode_by_depth), \
        dict(agent.predicted_decode_by_depth)
    assert chat_depths[0] > agent_depths[0] and agent_depths[32768] > chat_depths[32768]
    [ub_line] = [r for r in agent.reasons if r.startswith(f"ubatch {agent.n_ubatch} ")]
    assert re.search(r"over ubatch 256 .* serves the first prompt \([\d.]+ s faster\)", ub_line)
    [session] = [r for r in agent.reasons if "the session (agent:" in r]
    assert re.search(r"the first, 20000 tokens, [\d.]+ s", session)
    [chat_ub] = [r for r in chat.reasons if r.startswith(f"ubatch {chat.n_ubatch} ")]
    assert re.search(r"over ubatch 2048 .* serves [^;]*answers up to \d+ tokens", chat_ub)
    # Issue 36: the chat's session alone chose ubatch 256, which read a 16K prompt at half of
    # llama.cpp's speed (7.8 GiB of FFN weights in RAM cross per micro-batch); the floor keeps
    # a micro-batch of 512 and says what it costs and buys, by time to first token (at 14 GiB,
    # where the chat's session alone still takes 256).
    assert chat.n_ubatch >= 512
    chat = tune(shape, h200(14), Request(n_ctx=32768, margin_bytes=128 * MIB, workload=CHAT))
    assert chat.n_ubatch >= 512
    [floor] = [r for r in chat.reasons if r.startswith("prompt reading: ")]
    m = re.search(r"ubatch 512 reads a 16384-token prompt in ([\d.]+) s to the first token; "
                  r"ubatch 256 \(the plan otherwise chosen, session [\d.]+ s\) would take "
                  r"([\d.]+) s: [\d.]+ GiB of weights in RAM cross", floor)
    assert m and float(m.group(2)) > 1.25 * float(m.group(1)), floor


def test_workload_and_the_older_expected_fill_from_the_config(home):
    config_dir = home / "xdg_config_home" / "localllm"
    config_dir.mkdir(parents=True)
    assert config_request().workload == CHAT  # the default
    (config_dir / "config.toml").write_text('workload = "agent"\n')
    assert config_request().workload == AGENT
    (config_dir / "config.toml").write_text("expected_fill = 0.7\n")  # the older setting
    assert config_request().workload == from_fill(0.7)
    with pytest.raises(ConfigError):
        check_setting("workload", "batch")


def test_a_fill_workload_is_the_older_objective(shapes):
    """expected_fill 0.5 as a workload: decode averaged over half the context, as before."""
    shape = shapes["dense-27b"]
    plan = tune(shape, h200(12), Request(n_ctx=32768, workload=from_fill(0.5)))
    depths = dict(plan.predicted_decode_by_depth)
    assert depths[32768] < plan.predicted_decode_tps < depths[0]
    assert plan.predicted_session_s == pytest.approx(16384 / plan.predicted_decode_tps, rel=0.02)


# ---- never over budget -------------------------------------------------------------------------

def test_recurrent_state_snapshots_for_drafts_are_counted(shapes):
    """The runner keeps draft_n_max + 1 snapshots of the recurrent state per sequence
    (n_rs_seq); the plan's memory counts them, so an MTP plan of the Qwen3.5 shape stays in its
    budget."""
    shape = shapes["qwen35-27b"]
    costs = model_costs(shape)
    recurrent = next(i for i, b in enumerate(costs.state_bytes) if b)
    plain = ContextSettings(32768, "q8_0", "q8_0")
    assert block_kv_bytes(costs, recurrent, replace(plain, n_rs_seq=4)) == \
        5 * block_kv_bytes(costs, recurrent, plain)
    # All on the GPU (24 GiB) with a measured high acceptance: the plan drafts with MTP.
    plan = tune(shape, h200(24), Request(n_ctx=32768, acceptance={"mtp": 0.95}))
    assert plan.speculative == "mtp", plan.reasons
    settings = settings_of(plan)
    assert settings.n_rs_seq == plan.draft_n_max + 1
    loaded = memory_by_device(model_costs(shape, load_mtp=True), placement_of(plan, shape),
                              settings, h200(24))
    gpu_kv = next(m.kv for m in loaded if m.device == "CUDA0")
    assert next(m.kv for m in plan.memory if m.device == "CUDA0") >= gpu_kv


# ---- plans per fill band -----------------------------------------------------------------------

def test_plans_per_fill_band(shapes):
    shape = shapes["dense-27b"]
    bands = band_plans(shape, h200(12), Request(n_ctx=131072, margin_bytes=128 * MIB,
                                                workload=AGENT))
    assert [b for b, _ in bands] == [8192, 32768, 131072]
    small, mid, whole = (p for _, p in bands)
    assert small.n_ctx == 8192 and whole.n_ctx == 131072
    # A smaller band holds less KV, so it keeps more on the GPU and decodes faster at its start.
    assert dict(small.predicted_decode_by_depth)[0] > dict(whole.predicted_decode_by_depth)[0]
    assert all(b.workload for _, b in bands)
    # The agent's 20K first prompt never runs in the 8K band (a runner starts in the band that
    # holds the prompt): that band is planned for short requests, the 32K one for the session.
    assert small.workload == CHAT.describe() and mid.workload == AGENT.describe()


def test_a_band_serves_the_part_of_the_session_that_fits_it():
    assert AGENT.in_band(8192) is CHAT  # its first turn (20000 + 256 tokens) does not fit
    assert AGENT.in_band(20256) is AGENT and AGENT.in_band(32768) is AGENT
    assert CHAT.in_band(2048) is CHAT
    half = from_fill(0.5)
    assert half.in_band(8192) is half  # the older objective: half of whatever context


def test_auto_keeps_a_band_only_where_it_decodes_faster_after_a_short_prompt(shapes):
    from localllm.profiles.bands import band_pays

    shape = shapes["qwen35-27b"]
    whole = tune(shape, h200(12), Request(n_ctx=32768, margin_bytes=128 * MIB, workload=AGENT))
    [(_, band), _] = band_plans(shape, h200(12), Request(n_ctx=32768, margin_bytes=128 * MIB,
                                                         workload=AGENT), whole_plan=whole)
    assert band_pays(band, whole)
    # Measured on the H200: a band planned to read a prompt it never reads (ubatch 2048, whole
    # blocks, the lm-head on the CPU) decoded 8.6 tok/s where the whole plan did 11.7.
    start = whole.predicted_decode_by_depth[0][1]
    slower = replace(band, predicted_decode_by_depth=((0, start * 0.6), (8192, start * 0.55)))
    assert not band_pays(slower, whole)
    assert not band_pays(replace(whole, n_ctx=8192), whole)  # the same placement: no gain
    # a band measuring the ways `auto` weighs is kept while any is unmeasured, however priced
    settling = replace(slower, way="no-pool", ways=(("pool-gpu", 90.0, 103.5),
                                                    ("no-pool", 60.0, 0.0)))
    assert band_pays(settling, whole)
    settled = replace(settling, ways=(("pool-gpu", 90.0, 103.5), ("no-pool", 60.0, 75.0)))
    assert not band_pays(settled, whole)
    same_blocks = replace(settled, n_ctx=8192, predicted_decode_by_depth=((0, start * 1.3),), **{
        f: getattr(whole, f) for f in ("n_gpu_layers", "tensor_overrides", "tensor_split",
                                       "n_batch", "n_ubatch", "flash_attn", "expert_cache",
                                       "expert_misses_on_gpu", "expert_cache_device")})
    assert not band_pays(same_blocks, whole)
    # The same blocks in RAM with a pool where the whole plan has none is another way to run:
    # on an H100 lease the 8K band's pool (misses on the CPU) decoded 115 tok/s, and dropping
    # it as "the same placement" left short answers to the whole plan's 82.
    assert whole.expert_cache == 0
    assert band_pays(replace(same_blocks, expert_cache=1024), whole)


def test_the_daemon_loads_fill_bands_only_where_they_move_weights(shapes):
    from localllm.profiles.bands import choose_bands, placement_key

    from localllm.options import LoadOptions

    shape, card = shapes["dense-27b"], h200(12)
    whole = tune(shape, card, Request(n_ctx=131072, margin_bytes=512 * MIB, workload=CHAT,
                                      num_parallel=1))
    bands, entered = choose_bands(shape, "dense", LoadOptions(), card, whole, "auto")
    assert [b.n_ctx for b in bands] == [8192, 32768]
    # Beside bands the whole context is entered by a prompt past 32K: planned for reading it.
    assert entered.n_ctx == whole.n_ctx
    assert entered.workload.startswith(
        "agent (long prompt): conversations that open with about 65536 tokens")
    assert (entered.type_k, entered.n_parallel) == (whole.type_k, whole.n_parallel)
    assert entered.n_ubatch >= max(1024, whole.n_ubatch)
    assert dict(entered.predicted_ttft)[65536] < dict(whole.predicted_ttft)[65536]
    for band in bands:  # what a runner carries KV across must match; the placement differs
        assert (band.type_k, band.type_v, band.n_parallel, band.speculative) == \
            (whole.type_k, whole.type_v, whole.n_parallel, whole.speculative)
        assert placement_key(band) != placement_key(whole)
        assert band.vram_bytes() <= card.free_vram_bytes
    assert bands[0].n_gpu_layers >= whole.n_gpu_layers
    assert choose_bands(shape, "dense", LoadOptions(), card, whole, "off") == ((), whole)
    edited = replace(whole, source="profile:/home/u/.config/localllm/profiles/x.toml")
    assert choose_bands(shape, "dense", LoadOptions(), card, edited, "auto") == ((), edited)
    cpu = load_card("cpu-only").with_host(**H200_HOST)
    on_cpu = tune(shape, cpu, Request(n_ctx=16384, workload=CHAT, num_parallel=1))
    assert choose_bands(shape, "dense", LoadOptions(), cpu, on_cpu, "auto") == ((), on_cpu)
    [given], _ = choose_bands(shape, "dense", LoadOptions(), cpu, on_cpu, "4096,16384")
    assert given.n_ctx == 4096 and placement_key(given)[:3] == placement_key(on_cpu)[:3]


def test_a_faster_plan_the_quality_policy_forbids_is_rejected_for_that_reason(shapes):
    """The Qwen3.5 shape at 32K on a 12 GiB card: q4_0 KV would be faster, and balanced quality
    does not allow it; the rejected line says so rather than comparing moments it wins."""
    plan = tune(shapes["qwen35-27b"], h200(12),
                Request(n_ctx=32768, margin_bytes=128 * MIB, workload=AGENT, num_parallel=1))
    assert plan.type_k != "q4_0"
    q4 = [r for r in plan.reasons if r.startswith("rejected: q4_0 KV")]
    assert q4, plan.reasons
    sessions = [float(re.search(r"session (\d+) s;", r).group(1)) for r in q4]
    assert min(sessions) < plan.predicted_session_s, (sessions, plan.predicted_session_s)
    assert all(r.endswith("quality balanced does not allow q4_0 KV") for r in q4), q4
    pinned = tune(shapes["qwen35-27b"], h200(12),
                  Request(n_ctx=32768, margin_bytes=128 * MIB, workload=AGENT, num_parallel=1,
                          quality="speed"))
    assert not any("does not allow" in r for r in pinned.reasons), pinned.reasons
