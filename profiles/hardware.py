"""The probe: which card and host this machine has (NVML for GPUs, the OS for RAM and cores).

The only place that touches the hardware. Everything it finds becomes a `Card`, so the tuner
plans for a probed machine and for a profile the same way.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache

from localllm.llama import nvml

from .card import CPU_ONLY, GIB, MIB, Card, load_card, match_card
from .plan import physical_cores


def host_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GIB


def estimate_host_bandwidth(cores: int) -> float:
    """GB/s that llama.cpp's CPU layers reach reading weights, before `--measure` calibrates it.

    Decode on the CPU is bound by memory and by how many cores stream it: 16 server cores
    reached about 51 GB/s under a GPU plan (dense-27b with 37 blocks in RAM, 6.1 tok/s) and
    57 GB/s all on the CPU; a desktop's two channels cap near 60.
    """
    return min(3.2 * cores, 60.0)


def host_card() -> Card:
    """No GPU: the cpu-only profile with this machine's RAM and physical cores."""
    cores = physical_cores()
    return replace(
        load_card(CPU_ONLY).with_host(host_ram_bytes(), cores, estimate_host_bandwidth(cores)),
        source="probe",
    )


def card_from_nvml(devices: list[dict], ram_bytes: int, cores: int) -> Card:
    """A Card for the GPUs NVML reported: the matching profile with the real memory, or one
    built from NVML's clocks and bus width when no profile matches."""
    first = devices[0]
    free = min(d["free"] for d in devices)
    profile = match_card(first["name"], first["total"])
    if profile:
        card = load_card(profile)
    else:
        gen, width = int(first.get("pcie_gen", 4)), int(first.get("pcie_width", 16))
        # Theoretical peak: double data rate x bus width; PCIe about 2 GB/s per lane per gen 4.
        bandwidth = 2 * first.get("mem_clock_mhz", 5000) * first.get("bus_width", 256) / 8 / 1000
        card = Card(
            name=first["name"].lower().replace("nvidia ", "").replace(" ", "-"),
            label=first["name"], vram_bytes=first["total"], free_vram_bytes=free,
            bandwidth_gbs=bandwidth, pcie_gbs=0.8 * 2 ** (gen - 4) * 2 * width,
            compute_capability=str(first.get("cc", "")), fp16_tflops=50.0,
            overhead_bytes=500 * MIB, decode_efficiency=0.6, ram_bytes=ram_bytes,
            cores=cores, host_bandwidth_gbs=estimate_host_bandwidth(cores),
        )
    return replace(
        card, vram_bytes=first["total"], free_vram_bytes=free, n_gpus=len(devices),
        ram_bytes=ram_bytes, cores=cores, host_bandwidth_gbs=estimate_host_bandwidth(cores),
        source="probe",
    )


@lru_cache(maxsize=1)
def probe_card() -> Card:
    """This machine: its GPUs matched to a profile (by name and memory) with real free memory,
    or the cpu-only profile with real RAM and cores where there is no GPU."""
    devices = nvml.devices()
    if not devices:
        return host_card()
    cores = physical_cores()
    return card_from_nvml(devices, host_ram_bytes(), cores)


def resolve_card(name: str | None) -> Card:
    """`--card NAME|auto`: a profile (planned with this machine's host) or the probe."""
    if not name or name == "auto":
        return probe_card()
    card = load_card(name)
    host = host_card()
    return card.with_host(host.ram_bytes, host.cores, host.host_bandwidth_gbs)
