"""Plans past RAM: weights beyond VRAM plus the RAM budget stay mmapped and are read from disk
per token; the plan says how much and at what rate, and predicts decode with it."""

from __future__ import annotations

import os
import re
from dataclasses import replace

import pytest
from scripts import synth_gguf

from localllm.modelstore.shape import read_shape
from localllm.planner.card import GIB, load_card
from localllm.planner.disk import ASSUMED_DISK_GBS
from localllm.planner.budgets import ram_budget, vram_budget
from localllm.planner.search import Request
from localllm.planner.tuner import tune


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return read_shape(paths["70b"])  # 37 GiB of Q4_0 weights


def disk_lines(plan) -> list[str]:
    return [r for r in plan.reasons if "read from disk per token" in r]


def test_weights_past_ram_are_read_from_disk_and_cost_speed(big):
    # No disk rate known (the profile's taken away): the assumed one, said so.
    small = replace(load_card("rtx3060-12g").with_host(16 * GIB, 8, 40.0), disk_read_gbs=0)
    roomy = replace(load_card("rtx3060-12g").with_host(64 * GIB, 8, 40.0), disk_read_gbs=0)
    request = Request(n_ctx=4096)
    spilled, in_ram = tune(big, small, request), tune(big, roomy, request)

    assert not disk_lines(in_ram)
    [line] = disk_lines(spilled)
    assert f"at {ASSUMED_DISK_GBS:.1f} GB/s (assumed)" in line
    # The figure is the CPU's weights beyond what the RAM budget leaves after KV and buffers.
    cpu = next(m for m in spilled.memory if m.device == "CPU")
    excess = cpu.total - ram_budget(small)
    assert excess > 0 and line.startswith(f"{excess / GIB:.1f} GiB read from disk")
    # Past RAM the file stays mapped and pageable; within RAM the mapped weights are pinned in
    # place (PCIe-speed copies when a prompt's micro-batches take them to the GPU: speed.py).
    assert spilled.use_mmap and in_ram.use_mmap
    assert in_ram.pin_in_place and not spilled.pin_in_place
    assert any("pin_in_place" in r for r in in_ram.reasons)
    assert not any("pin_in_place" in r for r in spilled.reasons)
    assert spilled.predicted_decode_tps < in_ram.predicted_decode_tps
    # Reading the excess at the assumed rate alone bounds the speed from above.
    assert spilled.predicted_decode_tps < ASSUMED_DISK_GBS * 1e9 / excess
    for plan, card in ((spilled, small), (in_ram, roomy)):
        for m in plan.memory:
            if m.device != "CPU":
                assert m.total <= vram_budget(card, request.margin_bytes)


def test_a_measured_disk_rate_is_used_and_named(big):
    assumed = replace(load_card("rtx3060-12g").with_host(16 * GIB, 8, 40.0), disk_read_gbs=0)
    fast = replace(assumed, disk_read_gbs=6.5, source="probe")  # as `calibrated` leaves it
    slow_plan, fast_plan = tune(big, assumed, Request(n_ctx=4096)), tune(big, fast,
                                                                         Request(n_ctx=4096))
    [line] = disk_lines(fast_plan)
    assert "at 6.5 GB/s (measured by tune --calibrate)" in line
    [line] = disk_lines(tune(big, load_card("rtx3060-12g").with_host(16 * GIB, 8, 40.0),
                             Request(n_ctx=4096)))
    assert "at 1.5 GB/s (the card profile's figure)" in line  # the box's [host] disk_gbs
    assert fast_plan.predicted_decode_tps > slow_plan.predicted_decode_tps


def test_cpu_only_host_smaller_than_the_model(big):
    cpu = load_card("cpu-only").with_host(24 * GIB, 8, 40.0)
    plan = tune(big, cpu, Request(n_ctx=4096))
    [line] = disk_lines(plan)
    gib_read = float(re.match(r"([\d.]+) GiB", line).group(1))
    assert 37.0 - 24 < gib_read < 37.0  # more than the model's excess over RAM, less than all
    assert plan.n_gpu_layers == 0 and plan.predicted_decode_tps < 1.0


def test_more_ram_is_never_slower(big):
    speeds = [tune(big, load_card("rtx3060-12g").with_host(ram * GIB, 8, 40.0),
                   Request(n_ctx=4096)).predicted_decode_tps for ram in (12, 16, 24, 32, 48, 64)]
    assert speeds == sorted(speeds)
    assert speeds[0] < speeds[-1]


# ---- tune --calibrate: the disk read rate ------------------------------------------------------

def written_file(path, size: int):
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    return path


def test_disk_read_is_measured_stored_and_used(tmp_path):
    from localllm.profiles.calibrate import PAGE, measure_disk_read, store_disk_read
    from localllm.profiles.calibration import calibrated

    model = written_file(tmp_path / "model.gguf", 96 << 20)
    measured = measure_disk_read(model)
    assert measured.bytes_read == 96 << 20 and measured.gbs > 0
    assert measured.how  # says how (or whether) the page cache was kept out
    # read as decode reads weights past RAM: page faults through a mapping, a span per thread
    three = measure_disk_read(model, threads=3)
    assert "mapping from 3 threads" in three.how
    assert three.bytes_read == (96 << 20) // 3 // PAGE * PAGE * 3 and three.gbs > 0
    path = tmp_path / "calibration.toml"
    store_disk_read(measured, path)
    for name in ("rtx3060-12g", "cpu-only"):  # a host figure: the card probed here has it
        card = calibrated(replace(load_card(name), source="probe"), path)
        assert card.disk_read_gbs == round(measured.gbs, 2)
    # A profile is another box (issue 38): it keeps its own disk, not this host's.
    assert calibrated(load_card("rtx3060-12g"), path).disk_read_gbs == 1.5


def test_disk_read_refuses_files_that_measure_nothing(tmp_path):
    from localllm.errors import UserError
    from localllm.profiles.calibrate import measure_disk_read

    sparse = tmp_path / "sparse.gguf"
    with open(sparse, "wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(UserError, match="sparse"):
        measure_disk_read(sparse)
    with pytest.raises(UserError, match="too small"):
        measure_disk_read(written_file(tmp_path / "small.gguf", 1 << 20))


def test_the_daemon_plans_with_what_tune_calibrated(big, tmp_path, monkeypatch):
    """`tune --calibrate` stores the disk's rate; the daemon's loads must plan with it too, or
    `tune` explains one plan and the daemon loads another."""
    from localllm.daemon.scheduler import Planner
    from localllm.options import LoadOptions
    from localllm.profiles.calibration import HOST_KEY
    from localllm.profiles.calibration import calibration_file

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("LOCALLLM_RAM_BUDGET", "8G")  # the 37 GiB model spills past RAM here
    before = Planner().choose(big, "big", 4096, LoadOptions())
    [line] = disk_lines(before)
    assert "(assumed)" in line
    calibration_file().parent.mkdir(parents=True, exist_ok=True)
    calibration_file().write_text(f"[{HOST_KEY}]\ndisk_read_gbs = 7.25\n")
    after = Planner().choose(big, "big", 4096, LoadOptions())
    [line] = disk_lines(after)
    assert "at 7.2 GB/s (measured by tune --calibrate)" in line or \
        "at 7.3 GB/s (measured by tune --calibrate)" in line
    assert after.predicted_decode_tps > before.predicted_decode_tps
