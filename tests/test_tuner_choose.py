"""The daemon's hooks (choose_plan, step_down), saved profiles a user edits, tensor overrides in
a real llama.cpp load, and `localllm tune` end to end."""

from __future__ import annotations

import json
import sys

import llama_cpp
import pytest
from scripts import synth_gguf

from localllm.cli.main import main
from localllm.modelstore.shape import read_shape
from localllm.options import LoadOptions
from localllm.planner.card import GIB, load_card
from localllm.profiles.choose import choose_plan, placement_of, step_down
from localllm.engine.hardware import host_card, probe_card
from localllm.engine.overrides import tensor_overrides_applied
from localllm.planner.plan import Plan, TensorOverride, physical_cores
from localllm.profiles.saved import (
    ProfileError, find_profile, load_profile, profile_path, save_profile,
)
from localllm.planner.placements import tensor_overrides
from localllm.planner.search import Request
from localllm.planner.tuner import tune


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    return synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")


def test_choose_plan_on_a_cpu_only_machine_is_all_cpu(home, smollm2_gguf):
    shape = read_shape(smollm2_gguf)
    card = host_card()  # this machine as it would probe without a GPU, wherever the test runs
    plan = choose_plan(shape, "smollm2", None, LoadOptions(), card=card)
    assert plan.n_gpu_layers == 0 and not plan.tensor_overrides
    assert plan.n_ctx == min(4096, shape.context_length)
    assert plan.n_threads == physical_cores() and plan.type_k == "f16"
    assert [m.device for m in plan.memory] == ["CPU"] and plan.memory[0].weights > 0
    asked = choose_plan(shape, "smollm2", 2048, LoadOptions(num_thread=1, num_batch=64),
                        card=card)
    assert asked.n_ctx == 2048 and asked.n_threads == 1 and asked.n_batch == 64
    assert asked.n_ubatch <= 64


def test_saved_profile_is_used_and_bad_edits_are_reported(home, smollm2_gguf):
    shape = read_shape(smollm2_gguf)
    card = probe_card()
    tuned = choose_plan(shape, "smollm2", 1024, LoadOptions(), card=card)
    path = save_profile(tuned, "smollm2", card.name, shape.file_size)
    assert path == profile_path("smollm2", card.name) and path.is_file()
    text = path.read_text().replace("n_threads = ", "n_threads = 1 #", 1)
    path.write_text(text)
    plan = choose_plan(shape, "smollm2", None, LoadOptions(), card=card)
    assert plan.source == f"profile:{path}" and plan.n_threads == 1 and plan.n_ctx == 1024
    path.write_text(text.replace('type_k = "f16"', 'type_k = "q3_z"'))
    with pytest.raises(ProfileError, match="q3_z.*is not a KV cache type"):
        load_profile(path)
    plan = choose_plan(shape, "smollm2", None, LoadOptions(), card=card)  # reported, not crashed on
    assert plan.source == "tuner"
    assert any("saved profile ignored" in r and "q3_z" in r for r in plan.reasons)
    path.write_text("this is [not toml")
    assert choose_plan(shape, "smollm2", None, LoadOptions(), card=card).source == "tuner"


@pytest.mark.parametrize("edit, message", [
    ("n_ctx = 100", "at least 256"),
    ("n_gpu_layers = \"all\"", "whole number"),
    ("flash_attn = \"yes\"", "true or false"),
    ("bogus = 1", "unknown plan setting 'bogus'"),
    ("tensor_overrides = [{pattern = \"(\", device = \"CPU\"}]", "tensor override pattern"),
])
def test_invalid_profile_edits_name_the_problem(home, edit, message):
    plan = Plan(n_ctx=4096, type_k="q8_0", type_v="q8_0", flash_attn=True)
    path = save_profile(plan, "m", "rtx3090", 1)
    key = edit.split(" =")[0]
    lines = [line for line in path.read_text().splitlines() if not line.startswith(f"{key} =")]
    at = lines.index("[plan]") + 1
    path.write_text("\n".join(lines[:at] + [edit] + lines[at:]) + "\n")
    with pytest.raises(ProfileError, match=message):
        find_profile("m", "rtx3090")


def test_profile_roundtrip_keeps_overrides(home):
    plan = Plan(n_ctx=8192, n_gpu_layers=20, type_k="q4_0", type_v="q4_0", flash_attn=True,
                tensor_overrides=(TensorOverride(r"^output\.weight$", "CPU"),))
    save_profile(plan, "27b-q3", "rtx3060-12g", 123)
    loaded = find_profile("27b-q3", "rtx3060-12g")
    assert loaded.plan.load_key() == plan.load_key() and loaded.model_size == 123


def test_step_down_needs_less_vram_then_cpu_then_nothing(home, headers):
    shape = read_shape(headers["dense-27b"])
    card = load_card("rtx3090").with_host(64 * GIB, 8, 50.0)
    plan = tune(shape, card, Request(n_ctx=32768))
    seen = [plan]
    while True:
        smaller = step_down(seen[-1], shape, card, model_name="dense-27b")
        if smaller is None:
            break
        assert smaller.vram_bytes() < seen[-1].vram_bytes()
        assert smaller.n_ctx == plan.n_ctx
        seen.append(smaller)
        assert len(seen) < 40
    assert len(seen) >= 3 and seen[-1].n_gpu_layers == 0
    saved = find_profile("dense-27b", card.name)
    assert saved is not None and len(saved.history) == len(seen) - 1
    assert "out of memory" in saved.history[0]["event"]
    assert saved.plan.n_gpu_layers == 0  # the next load starts from what the last step chose


def test_placement_is_recovered_from_the_plan(headers):
    shape = read_shape(headers["qwen3-30b-a3b"])
    plan = tune(shape, load_card("rtx4060").with_host(64 * GIB, 8, 50.0), Request(n_ctx=8192))
    p = placement_of(plan, shape)
    assert (p.n_gpu_layers, tuple(tensor_overrides(shape, p))) == \
        (plan.n_gpu_layers, plan.tensor_overrides)


def test_tensor_overrides_reach_llama_cpp(tmp_path, capfd):
    tiny = synth_gguf.tiny(synth_gguf.SHAPES["llama-8b"])
    path = synth_gguf.write_gguf(tmp_path / "t.gguf", tiny)
    with tensor_overrides_applied([TensorOverride(r"^output\.weight$", "CPU")]):
        llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=True)
    llm.close()
    assert "output.weight" in capfd.readouterr().err.split("overridden")[0].splitlines()[-1]
    assert llama_cpp.llama_cpp.llama_model_default_params().tensor_buft_overrides is None


def test_tune_cli_prints_explains_and_saves(home, headers, capsys):
    code = main(["tune", str(headers["gemma3-27b"]), "--card", "rtx3060-12g", "--ctx", "32768"])
    out = capsys.readouterr().out
    assert code == 0
    assert "CUDA0" in out and "headroom" in out and "why:" in out and "rejected:" in out
    assert "context 32768, as asked" in out
    assert profile_path("gemma3-27b-q4_0", "rtx3060-12g").is_file()
    code = main(["tune", str(headers["llama-8b"]), "--card", "rtx4090", "--vram", "6",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["plan"]["n_ctx"] >= 4096 and data["profile"] is None
    assert data["card"]["vram_bytes"] == 6 * GIB


def test_tune_shows_the_fill_bands_the_daemon_would_load(home, headers, capsys, monkeypatch):
    argv = ["tune", str(headers["dense-27b"]), "--card", "h200", "--vram", "12", "--ctx",
            "32768", "--workload", "agent"]
    assert main(argv) == 0
    out = capsys.readouterr().out.split("plans per fill band")[1]
    # The agent's first prompt does not fit 8K: that band is planned for short requests.
    assert "up to 8192 (chat):" in out and "up to 32768 (agent):" in out
    assert "loaded while the sequences fit it" in out and "the whole context" in out
    monkeypatch.setenv("LOCALLLM_FILL_BANDS", "off")
    assert main(argv) == 0
    assert "plans per fill band" not in capsys.readouterr().out
    monkeypatch.setenv("LOCALLLM_FILL_BANDS", "4096,16384")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "up to 4096" in out and "up to 16384" in out and "up to 8192" not in out


@pytest.mark.parametrize("argv, message", [
    (["tune", "no-such-model"], "not found"),
    (["tune", "/nonexistent/x.gguf"], "no such model file"),
    (["tune", "MODEL", "--card", "gtx-9999"], "unknown card"),
    (["tune", "MODEL", "--vram", "-2"], "--vram must be"),
    # Weights past RAM are read from disk, the KV cache is not: 80 GiB of f32 KV fits no test
    # machine's RAM.
    (["tune", "MODEL", "--card", "rtx4060", "--ctx", "131072", "--vram", "2", "--kv", "f32"],
     "no plan fits"),
])
def test_tune_cli_errors_are_one_line(home, headers, capsys, argv, message):
    argv = [str(headers["70b"]) if a == "MODEL" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_tune_measure_times_the_plan_and_calibrates(home, smollm2_gguf, capsys):
    # One thread: on a busy two-core test machine, spinning OpenMP threads can slow decode 100x.
    assert main(["tune", str(smollm2_gguf), "--ctx", "1024", "--threads", "1", "--measure"]) == 0
    out = capsys.readouterr().out
    assert "measured: prefill" in out
    saved = find_profile(smollm2_gguf.stem, probe_card().name)
    assert saved.measured["decode_tps"] > 0 and saved.measured["decoded_tokens"] > 0
    from localllm.profiles.calibration import calibrated, load_calibration

    entry = load_calibration()[probe_card().name]
    assert entry["measured_decode_tps"] > 0
    assert calibrated(probe_card()).host_bandwidth_gbs != probe_card().host_bandwidth_gbs or \
        entry.get("gpu_bandwidth_factor")


def test_calibrate_without_torch_says_what_to_install(smollm2_gguf, home):
    import subprocess
    import sys

    from localllm.engine.hardware import probe_card
    from localllm.profiles.calibration import load_calibration

    result = subprocess.run([sys.executable, "-m", "localllm.cli", "tune", str(smollm2_gguf),
                             "--calibrate", "--no-save"], capture_output=True, text=True,
                            timeout=120)
    # The disk is measured first, GPU or not, and kept.
    assert "calibrated the disk" in result.stderr, result.stderr
    assert load_calibration()["host"]["disk_read_gbs"] > 0
    try:
        import torch
    except ImportError:
        torch = None
    if not probe_card().has_gpu:
        assert result.returncode == 0 and "only the disk was measured" in result.stderr
    elif torch is None:
        assert result.returncode == 1
        assert "needs torch" in result.stderr and "Traceback" not in result.stderr
    elif not torch.cuda.is_available():  # torch without CUDA here: the other clear refusal
        assert result.returncode == 1 and "CUDA GPU" in result.stderr


def test_calibrating_a_gpu_without_torch_says_what_to_install(home, monkeypatch):
    from localllm.errors import UserError
    from localllm.profiles.calibrate import calibrate
    from localllm.planner.card import load_card

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails, as without the extra
    with pytest.raises(UserError, match="needs torch"):
        calibrate(load_card("rtx3060-12g"))


def test_measured_bandwidth_replaces_the_theoretical_one(tmp_path):
    from localllm.engine.probes import Bandwidth
    from localllm.profiles.calibrate import store_bandwidth
    from localllm.planner.card import load_card
    from localllm.profiles.calibration import calibrated

    card = load_card("rtx3060-12g")
    path = tmp_path / "calibration.toml"
    store_bandwidth(card.name, Bandwidth(memory_gbs=301.5, host_to_device_gbs=11.2), path)
    tuned = calibrated(card, path)
    assert tuned.bandwidth_gbs == 301.5 and tuned.pcie_gbs == 11.2
    assert card.bandwidth_gbs != 301.5  # the profile itself is unchanged
    assert calibrated(load_card("rtx4090"), path) == load_card("rtx4090")
