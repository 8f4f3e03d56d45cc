"""Issue 65, prices from the machine: ggml's own CPU expert kernels timed on this machine (the
real libraries llama.cpp loads, a small buffer), in a runner of their own, stored under
`[host]` on first use and read back; a model whose expert types were all timed priced with
them, any other with the read rate as before; `tune --json` naming the source."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import pytest
import tomli_w

from h100_here import h100_here, qwen3_header
from localllm.engine.kernel_rates import measure_kernel_gbs
from localllm.engine.probes import TimeKernels
from localllm.engine.probing import ask
from localllm.planner.costs import model_costs
from localllm.planner.host_reads import expert_read_bps
from localllm.planner.memory import ContextSettings
from localllm.planner.placements import Placement
from localllm.planner.speed import predict_speed
from localllm.profiles.calibration import calibrated
from localllm.profiles.host_prices import measured_on_first_use, prices_of

SMALL = 8 << 20  # the experts of one block: milliseconds (the rates are not the point here)


@pytest.fixture(scope="module")
def costs(tmp_path_factory):
    return model_costs(qwen3_header(tmp_path_factory.mktemp("moe")))


def _this_machine(cores: int = 16):
    """The H100 at 12 GiB as this machine's probe gives it, its read rates not yet measured."""
    return replace(h100_here(), cores=cores, host_read_gbs=())


def test_the_kernels_are_timed_by_type_and_threads():
    rates = measure_kernel_gbs(["Q4_0", "Q6_K", "NOT_A_TYPE"], [1, 2], SMALL)
    assert set(rates) == {"Q4_0", "Q6_K"}  # a type ggml lacks is left out, not guessed
    assert all(set(by_threads) == {1, 2} for by_threads in rates.values())
    assert all(0 < gbs < 10_000 for by_threads in rates.values() for gbs in by_threads.values())


def test_the_runner_times_them_in_a_process_of_its_own():
    timed = ask(TimeKernels((1,), ("Q8_0",), SMALL), timeout=120)
    assert list(timed.by_type()) == ["Q8_0"] and timed.by_type()["Q8_0"][1] > 0


def test_timed_once_kept_and_read_back(tmp_path):
    path = tmp_path / "calibration.toml"
    # a factor serving fitted against the read rate's price, and one for the GPU's mapped reads
    path.write_text(tomli_w.dumps({"host": {"served_host_factor": 1.6,
                                            "served_mapped_factor": 1.2}}))
    card = _this_machine(cores=2)
    first = measured_on_first_use(calibrated(card, path), path, SMALL)
    stored = tomllib.loads(path.read_text())["host"]
    assert {"Q4_0", "Q4_K", "Q6_K"} <= set(stored["expert_gbs"]) and stored["expert_measured_at"]
    assert set(stored["expert_gbs"]["Q4_0"]) == {"1", "2"}
    assert dict(first.host_expert_gbs)["Q4_0"][0][0] == 1
    # the host factor went with the price it corrected; the mapped one is another price
    assert "served_host_factor" not in stored and stored["served_mapped_factor"] == 1.2
    assert first.served_host_factor == 1.0
    # the next plan reads them back and times nothing: a rate written by hand is what it gets
    stored["expert_gbs"]["Q4_0"]["2"] = 321.0
    path.write_text(tomli_w.dumps({"host": stored}))
    again = measured_on_first_use(calibrated(card, path), path, SMALL)
    assert dict(dict(again.host_expert_gbs)["Q4_0"])[2] == 321.0
    assert prices_of(again, path)["host_expert_gbs"]["source"].startswith(
        "ggml's CPU kernels timed on this machine at 20")


def test_a_damaged_kernel_table_loses_only_its_bad_type(tmp_path):
    path = tmp_path / "calibration.toml"
    path.write_text('[host.expert_gbs]\nQ4_0 = { "16" = "fast" }\nQ4_K = { "16" = 40.0 }\n')
    assert calibrated(_this_machine(), path).host_expert_gbs == (("Q4_K", ((16, 40.0),)),)


def test_the_model_knows_its_expert_types(costs):
    assert costs.expert_types == (("Q4_0", 1.0),)


def test_timed_types_price_the_experts_and_others_the_read_rate():
    card = replace(_this_machine(), host_read_gbs=((16, 80.0),),
                   host_expert_gbs=(("Q4_0", ((16, 40.0),)), ("Q6_K", ((16, 20.0),))))
    assert expert_read_bps(card, 16, (("Q4_0", 1.0),)) == pytest.approx(40e9)
    # each byte at its own type's rate: half at 40, half at 20 GB/s
    assert expert_read_bps(card, 16, (("Q4_0", 0.5), ("Q6_K", 0.5))) == pytest.approx(80e9 / 3)
    # a type not timed here: the read rate's price, as before the kernels were timed
    assert expert_read_bps(card, 16, (("Q4_0", 0.5), ("IQ2_XS", 0.5))) == pytest.approx(0.95 * 80e9)
    assert expert_read_bps(card, 16) == pytest.approx(0.95 * 80e9)


def test_a_slow_kernel_slows_the_predicted_decode(costs):
    """Lease E's host read RAM as fast as lease D's and multiplied experts 1.66x slower: with
    its kernels timed, a plan with experts in RAM is priced slower than the read rate says."""
    settings = ContextSettings(32768, "q8_0", "q8_0")
    placement = Placement(n_gpu_layers=49, n_cpu_expert_layers=24)
    reads = replace(_this_machine(), host_read_gbs=((16, 73.9),))
    kernels = replace(reads, host_expert_gbs=(("Q4_0", ((16, 73.9 / 1.66),)),))
    by_reads = predict_speed(costs, placement, settings, reads, 16).decode_tps
    by_kernels = predict_speed(costs, placement, settings, kernels, 16).decode_tps
    assert by_kernels < by_reads * 0.8
