"""The probe: which card and host this machine has (NVML for GPUs, the OS for RAM and cores).

The only place that touches the hardware. Everything it finds becomes a `Card`, so the tuner
plans for a probed machine and for a profile the same way. RAM is what is available when the
model loads (MemAvailable, capped by the cgroup's memory.max), not the machine's physical RAM:
other programs hold some, and a container may have less than the machine.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import lru_cache

from localllm.planner.card import CPU_ONLY, GIB, MIB, Card, Gpu, load_card, match_card
from localllm.planner.plan import physical_cores

from . import nvml


def host_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 * GIB


def mem_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's MemAvailable: free memory plus the page cache it can drop without swapping
    (other programs' memory is not in it). None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


# cgroup v1 writes "no limit" as the largest page-aligned 63-bit number
V1_UNLIMITED = 1 << 62


def cgroup_room_bytes(proc_cgroup: str = "/proc/self/cgroup",
                      root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup (and every group above it) still lets it allocate: the
    tightest limit less what that group already holds, its page cache excepted (the kernel
    reclaims that first). cgroup v2 (memory.max) or v1's memory controller
    (memory.limit_in_bytes, as older container hosts have it). None where no limit applies."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    v1 = next((path for _, controllers, path in lines if "memory" in controllers.split(",")),
              None)
    if v1 is not None:
        return _room(os.path.join(root, "memory"), v1, "memory.limit_in_bytes",
                     "memory.usage_in_bytes", "total_cache")
    v2 = next((path for hierarchy, controllers, path in lines
               if hierarchy == "0" and controllers == ""), None)
    if v2 is not None:
        return _room(root, v2, "memory.max", "memory.current", "file")
    return None


def _room(root: str, path: str, limit_file: str, usage_file: str, cache_key: str) -> int | None:
    room: int | None = None
    group = path.strip("/")
    while True:
        where = os.path.join(root, group) if group else root
        limit = _read_int(os.path.join(where, limit_file))
        if limit is not None and limit < V1_UNLIMITED:
            used = _read_int(os.path.join(where, usage_file)) or 0
            cache = _memory_stat(os.path.join(where, "memory.stat")).get(cache_key, 0)
            left = max(0, limit - max(0, used - cache))
            room = left if room is None else min(room, left)
        if not group:
            return room
        group = os.path.dirname(group)


def _read_int(path: str) -> int | None:
    """A cgroup file's number; None for "max" (no limit) or a file that is not there."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _memory_stat(path: str) -> dict[str, int]:
    try:
        with open(path) as f:
            return {k: int(v) for k, v in (line.split() for line in f if line.strip())}
    except (OSError, ValueError):
        return {}


def ram_available() -> int:
    """RAM a model may take now: MemAvailable, capped by the cgroup's room where one applies
    (a container's limit, a systemd unit's MemoryMax). 0 where neither can be read (plans then
    count the physical RAM less a reserve)."""
    found = [n for n in (mem_available_bytes(), cgroup_room_bytes()) if n is not None]
    return min(found) if found else 0


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
        source="probe", ram_available_bytes=ram_available(),
        disk_read_gbs=0.0,  # the profile's box is not this one: unknown until --calibrate
    )


def visible_devices(devices: list[dict], cuda_visible: str | None = None,
                    gpus: str = "all") -> list[dict]:
    """The NVML devices a runner may use: those CUDA_VISIBLE_DEVICES names (indices in PCI bus
    order, which the runner sets as CUDA_DEVICE_ORDER, or GPU UUIDs; CUDA stops at the first
    entry it cannot read, and so does this), narrowed to the `gpus` setting's indices."""
    out = list(devices)
    if cuda_visible is not None:
        chosen = []
        for token in (t.strip() for t in cuda_visible.split(",")):
            found = [d for d in devices if token.isdigit() and d.get("index") == int(token)
                     or token and not token.isdigit()
                     and str(d.get("uuid", "")).startswith(token)]
            if not found:
                break
            chosen += [d for d in found if d not in chosen]
        out = chosen
    if gpus.strip().lower() != "all":
        wanted = {int(t) for t in gpus.split(",") if t.strip()}
        out = [d for d in out if d.get("index") in wanted]
    return out


def _gpu_card(device: dict, ram_bytes: int, cores: int) -> Card:
    """The profile matching one NVML device, or one built from its clocks and bus width."""
    profile = match_card(device["name"], device["total"])
    if profile:
        return load_card(profile)
    gen, width = int(device.get("pcie_gen", 4)), int(device.get("pcie_width", 16))
    # Theoretical peak: double data rate x bus width; PCIe about 2 GB/s per lane per gen 4.
    bandwidth = 2 * device.get("mem_clock_mhz", 5000) * device.get("bus_width", 256) / 8 / 1000
    return Card(
        name=device["name"].lower().replace("nvidia ", "").replace(" ", "-"),
        label=device["name"], vram_bytes=device["total"], free_vram_bytes=device["free"],
        bandwidth_gbs=bandwidth, pcie_gbs=0.8 * 2 ** (gen - 4) * 2 * width,
        compute_capability=str(device.get("cc", "")), fp16_tflops=50.0,
        overhead_bytes=500 * MIB, decode_efficiency=0.6, ram_bytes=ram_bytes,
        cores=cores, host_bandwidth_gbs=estimate_host_bandwidth(cores),
    )


def card_from_nvml(devices: list[dict], ram_bytes: int, cores: int,
                   ram_available_bytes: int = 0) -> Card:
    """A Card for the GPUs NVML reported, each with its own memory and speed: the first one's
    profile (or NVML's clocks and bus width where none matches) describes the card, and every
    GPU its own free memory and bandwidth. Several of one kind keep the profile's name."""
    first = devices[0]
    card = _gpu_card(first, ram_bytes, cores)
    gpus = []
    for i, d in enumerate(devices):
        kind = card if d["name"] == first["name"] else _gpu_card(d, ram_bytes, cores)
        gpus.append(Gpu(f"CUDA{i}", d["name"], d["total"], d["free"], kind.bandwidth_gbs,
                        kind.fp16_tflops, int(d.get("index", i))))
    return replace(
        card, vram_bytes=first["total"], free_vram_bytes=min(d["free"] for d in devices),
        n_gpus=len(devices), gpus=tuple(gpus),
        ram_bytes=ram_bytes, cores=cores, host_bandwidth_gbs=estimate_host_bandwidth(cores),
        source="probe", ram_available_bytes=ram_available_bytes,
        disk_read_gbs=0.0,  # the profile's box is not this one: unknown until --calibrate
    )


@lru_cache(maxsize=4)
def _probe_devices(gpus: str = "all") -> Card:
    devices = visible_devices(nvml.devices(), os.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
    if not devices:
        return host_card()
    cores = physical_cores()
    return card_from_nvml(devices, host_ram_bytes(), cores)


def probe_card(gpus: str = "all") -> Card:
    """This machine: its GPUs (those CUDA_VISIBLE_DEVICES and the `gpus` setting leave) matched
    to a profile (by name and memory) with real free memory, or the cpu-only profile with real
    RAM and cores where there is no GPU. The devices are probed once; the RAM available is read
    again on every call (each load plans with what other programs left)."""
    return replace(_probe_devices(gpus), ram_available_bytes=ram_available())


def resolve_card(name: str | None, gpus: str = "all", ram_gib: float | None = None,
                 cores: int | None = None) -> Card:
    """`--card NAME|auto`: a profile, the whole box it describes (its GPUs and its [host]: RAM,
    cores, memory bandwidth, disk), or the probe of this machine (of the GPUs `gpus` names);
    `ram_gib` and `cores` (`--ram`, `--cores`) change the host's."""
    card = probe_card(gpus) if not name or name == "auto" else load_card(name)
    if ram_gib is None and cores is None:
        return card
    ram = int(ram_gib * GIB) if ram_gib is not None else card.ram_bytes
    # A RAM given is all the plan may count on: no probed MemAvailable beside it.
    return replace(card.with_host(ram, cores or card.cores, card.host_bandwidth_gbs),
                   ram_available_bytes=0 if ram_gib is not None else card.ram_available_bytes)
