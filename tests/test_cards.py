"""Card profiles and the hardware probe."""

from __future__ import annotations

import os

import pytest

from localllm.planner.card import GIB, MIB, CardError, card_names, load_card, match_card
from localllm.engine.nvml import devices as nvml_devices
from localllm.engine.hardware import card_from_nvml, probe_card, resolve_card
from localllm.planner.plan import physical_cores

CARDS = ["rtx3060-12g", "rtx3080", "rtx4060", "rtx4060ti-16g", "rtx4070", "rtx4070tis",
         "rtx4080", "rtx3090", "rtx4090", "rtx5090", "a100-40g", "a100-80g", "l40s", "h100",
         "h200", "cpu-only"]


def test_every_common_card_has_a_sane_profile():
    assert set(CARDS) <= set(card_names())
    for name in card_names():
        card = load_card(name)
        assert card.name == name and card.label
        assert card.ram_bytes > 0 and card.cores > 0 and card.host_bandwidth_gbs > 0
        if name == "cpu-only":
            assert not card.has_gpu and card.devices == ()
            continue
        assert card.has_gpu and card.devices == tuple(f"CUDA{i}" for i in range(card.n_gpus))
        assert 6 * GIB < card.vram_bytes < 150 * GIB
        assert 200 < card.bandwidth_gbs < 6000 and card.pcie_gbs > 5
        assert 0.2 < card.decode_efficiency <= 1 and card.overhead_bytes >= 256 * MIB
        assert card.nvml_names and card.compute_capability


def test_memory_sizes_match_the_reference():
    assert load_card("rtx3060-12g").vram_bytes == 12 * GIB
    assert load_card("rtx3090").bandwidth_gbs == 936
    assert load_card("h200").vram_bytes == 143771 * MIB
    assert load_card("rtx4060ti-16g").pcie_gbs < load_card("rtx4090").pcie_gbs  # x8 link


def test_unknown_card_names_the_known_ones():
    with pytest.raises(CardError, match="known cards: .*rtx3060-12g"):
        load_card("gtx-9999")


def test_broken_card_profile_is_a_clear_error(tmp_path):
    (tmp_path / "bad.toml").write_text('label = "x"\nvram_mib = "lots"\n')
    with pytest.raises(CardError, match="bad.toml is invalid"):
        load_card("bad", tmp_path)


def test_match_by_name_and_memory():
    # GeForce names carry no size: memory decides, and a card far from every profile matches none.
    assert match_card("NVIDIA GeForce RTX 3080", 12 * GIB) == "rtx3080-12g"
    assert match_card("NVIDIA GeForce RTX 3080", 10 * GIB) == "rtx3080"
    assert match_card("NVIDIA GeForce RTX 4060 Ti", 16 * GIB) == "rtx4060ti-16g"
    assert match_card("NVIDIA GeForce RTX 4060 Ti", 8 * GIB) is None
    assert match_card("NVIDIA H200", 143771 * MIB) == "h200"
    assert match_card("NVIDIA A100-SXM4-80GB", 80 * GIB) == "a100-80g"
    assert match_card("Some Other GPU", 16 * GIB) is None


def test_nvml_devices_become_a_card_with_real_free_memory():
    devices = [{"name": "NVIDIA GeForce RTX 3090", "total": 24 * GIB, "free": 20 * GIB},
               {"name": "NVIDIA GeForce RTX 3090", "total": 24 * GIB, "free": 22 * GIB}]
    card = card_from_nvml(devices, ram_bytes=64 * GIB, cores=12)
    assert card.name == "rtx3090" and card.source == "probe"
    assert card.n_gpus == 2 and card.devices == ("CUDA0", "CUDA1")
    assert card.free_vram_bytes == 20 * GIB  # the tighter of the two
    assert card.ram_bytes == 64 * GIB and card.cores == 12


def test_unmatched_gpu_is_described_from_nvml_clocks():
    devices = [{"name": "NVIDIA Mystery 9000", "total": 20 * GIB, "free": 19 * GIB,
                "cc": "9.9", "pcie_gen": 5, "pcie_width": 16, "mem_clock_mhz": 10000,
                "bus_width": 384}]
    card = card_from_nvml(devices, ram_bytes=32 * GIB, cores=8)
    assert card.label == "NVIDIA Mystery 9000"
    assert card.bandwidth_gbs == pytest.approx(960.0)  # 2 x 10000 MHz x 384 bit / 8
    assert card.pcie_gbs == pytest.approx(51.2)
    assert card.free_vram_bytes == 19 * GIB


def test_probe_on_this_machine_reports_real_host():
    card = probe_card()
    assert card.source == "probe"
    assert card.cores == physical_cores()
    assert card.ram_bytes == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if not nvml_devices():  # the test machines have no GPU: the cpu-only profile
        assert card.name == "cpu-only" and not card.has_gpu


def test_resolve_card_takes_the_whole_box_the_profile_describes():
    """Issue 38: `--card` swapped only the GPU, so a 27B on an RTX 3060 was planned with the
    2-core laptop's RAM and cores. A profile is a whole box; --ram and --cores change it."""
    card = resolve_card("rtx4090")
    assert card.vram_bytes == load_card("rtx4090").vram_bytes
    assert (card.ram_bytes, card.cores, card.disk_read_gbs) == (64 * GIB, 16, 1.5)
    assert card.source == "profile" and card.ram_available_bytes == 0
    changed = resolve_card("rtx4090", ram_gib=24, cores=6)
    assert (changed.ram_bytes, changed.cores) == (24 * GIB, 6)
    assert changed.vram_bytes == card.vram_bytes and changed.source == "profile+host"
    assert resolve_card("auto").source == "probe"
    assert resolve_card("auto", cores=3).cores == 3
    for name in card_names():  # every profile describes its box's disk too
        assert load_card(name).disk_read_gbs > 0, name


def test_with_vram_sets_an_emulated_budget():
    card = load_card("h200").with_vram(12)
    assert card.vram_bytes == card.free_vram_bytes == 12 * GIB
    assert card.bandwidth_gbs == 4800 and "12 GiB budget" in card.label
