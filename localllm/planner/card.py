"""Card: the GPUs (or their absence) and the host a plan is made for, from a profile or a probe.

`planner/cards/*.toml` describe the common cards so that any card can be planned for on any
machine (`localllm tune --card rtx3060-12g`); a profile with `base` and `gpus` describes a box of
several (`2x-rtx3090`), and `A+B` joins two profiles into one mixed box
(`--card rtx3090+rtx3060-12g`). `localllm.engine.hardware.probe_card` fills the same type from
NVML and the OS. Each GPU of a card is a `Gpu`, named as llama.cpp names it (CUDA0, CUDA1...).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from localllm.errors import UserError

CARDS_DIR = Path(__file__).resolve().parent / "cards"
MIB = 1 << 20
GIB = 1 << 30
CPU_ONLY = "cpu-only"


class CardError(UserError):
    """An unknown card name or a card profile that cannot be read."""


@dataclass(frozen=True)
class Gpu:
    """One GPU of a card: what the tuner splits layers over."""

    device: str  # llama.cpp's name among the visible devices: "CUDA0"
    label: str
    vram_bytes: int
    free_vram_bytes: int
    bandwidth_gbs: float
    fp16_tflops: float
    index: int = -1  # NVML's (PCI bus order) index when probed, -1 for a profile


@dataclass(frozen=True)
class Card:
    name: str  # profile name, e.g. "rtx3060-12g"
    label: str  # what a user reads, e.g. "NVIDIA GeForce RTX 3060 12GB"
    vram_bytes: int  # per GPU, total
    free_vram_bytes: int  # per GPU, free when probed (a profile assumes an idle card)
    bandwidth_gbs: float  # GPU memory, GB/s peak
    pcie_gbs: float  # usable host->device copy rate, GB/s
    compute_capability: str
    fp16_tflops: float
    overhead_bytes: int  # per GPU and process: CUDA context, cuBLAS, driver
    decode_efficiency: float  # fraction of peak bandwidth batch-1 decode reaches
    ram_bytes: int
    cores: int  # physical cores
    host_bandwidth_gbs: float  # what CPU layers reach reading weights from RAM
    n_gpus: int = 1
    nvml_names: tuple[str, ...] = ()
    # "profile", "probe", or "profile+host" (the card from a profile, its host changed by
    # tune --ram/--cores)
    source: str = "profile"
    # The host's disk read rate, GB/s, from `tune --calibrate` or a profile's [host] disk_gbs;
    # 0: not measured (plans past RAM assume planner.disk.ASSUMED_DISK_GBS)
    disk_read_gbs: float = 0.0
    # RAM a model may take when probed: MemAvailable capped by the cgroup's memory.max
    # (engine/hardware.py ram_available); 0: not probed (plans count ram_bytes less a reserve)
    ram_available_bytes: int = 0
    # The host's read rate by thread count, GB/s, measured on this machine
    # (profiles/host_prices.py): what the CPU's expert matmuls stream at decode; empty:
    # not measured (they are priced at host_bandwidth_gbs shared out by threads)
    host_read_gbs: tuple[tuple[int, float], ...] = ()
    # ggml's CPU expert kernels timed on this machine (profiles/host_prices.py,
    # engine/kernel_rates.py): per ggml type ("Q4_K"), GB/s of expert weights by thread count;
    # where a model's expert types are all here they price its experts in RAM, not the read rate
    host_expert_gbs: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    # How much slower (above 1) or faster the decodes this machine served were than priced,
    # put on the part of a step each one's error was laid to (profiles/served_speed.py): the
    # host's seconds (weights and experts the CPU reads, its attention) and the GPU's reads of
    # missed experts in pinned RAM. 1.0: nothing served differed by more than the check's gap.
    served_host_factor: float = 1.0
    served_mapped_factor: float = 1.0
    # The GPUs one by one, where they differ (a mixed box, a probe that read each one's free
    # memory); empty: n_gpus alike, each as the fields above say.
    gpus: tuple[Gpu, ...] = ()

    @property
    def has_gpu(self) -> bool:
        return self.n_gpus > 0 and self.vram_bytes > 0

    @cached_property  # asked for by every price the search makes
    def gpu_list(self) -> tuple[Gpu, ...]:
        """Every GPU, in llama.cpp's device order."""
        if not self.has_gpu:
            return ()
        if self.gpus:
            return self.gpus
        return tuple(Gpu(f"CUDA{i}", self.label, self.vram_bytes, self.free_vram_bytes,
                         self.bandwidth_gbs, self.fp16_tflops) for i in range(self.n_gpus))

    @cached_property
    def devices(self) -> tuple[str, ...]:
        """llama.cpp's device names for the GPUs, in order."""
        return tuple(g.device for g in self.gpu_list)

    def gpu(self, device: str) -> Gpu:
        for g in self.gpu_list:
            if g.device == device:
                return g
        raise KeyError(device)

    def with_vram(self, gib: float) -> Card:
        """The same card with a smaller (or larger) memory on each GPU: `--vram`, or a budget
        emulated on a bigger card. The usable part is what is free, so both move together."""
        total = int(gib * GIB)
        gpus = tuple(replace(g, vram_bytes=total, free_vram_bytes=total) for g in self.gpus)
        return replace(self, vram_bytes=total, free_vram_bytes=total, gpus=gpus,
                       label=f"{self.label}, {gib:g} GiB budget")

    def less_vram(self, nbytes: int) -> Card:
        """The card with `nbytes` of the first GPU kept for something else (a vision projector,
        which llama.cpp's mtmd puts on the first GPU)."""
        gpus = tuple(replace(g, vram_bytes=g.vram_bytes - nbytes,
                             free_vram_bytes=g.free_vram_bytes - nbytes) if i == 0 else g
                     for i, g in enumerate(self.gpus))
        free = min((g.free_vram_bytes for g in gpus), default=self.free_vram_bytes - nbytes)
        return replace(self, vram_bytes=self.vram_bytes - nbytes, free_vram_bytes=free,
                       gpus=gpus)

    def with_host(self, ram_bytes: int, cores: int, host_bandwidth_gbs: float) -> Card:
        return replace(self, ram_bytes=ram_bytes, cores=cores,
                       host_bandwidth_gbs=host_bandwidth_gbs,
                       source="profile+host" if self.source == "profile" else self.source)


def card_names(directory: Path = CARDS_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.toml"))


def load_card(name: str, directory: Path = CARDS_DIR) -> Card:
    """The profile `cards/NAME.toml`, or `A+B`: a box with the GPUs of both profiles (the host
    of the first); CardError names the known cards when NAME is not one."""
    if "+" in name:
        return join_cards([load_card(part, directory) for part in name.split("+")], name)
    path = directory / f"{name}.toml"
    if not path.is_file():
        raise CardError(f"unknown card {name!r}; known cards: {', '.join(card_names(directory))}")
    try:
        doc = tomllib.loads(path.read_text())
        if "base" in doc:  # several GPUs of one profile in one box
            return _several(name, doc, load_card(str(doc["base"]), directory))
        host = doc.get("host", {})
        has_gpu = int(doc["vram_mib"]) > 0
        return Card(
            name=name,
            label=str(doc["label"]),
            vram_bytes=int(doc["vram_mib"]) * MIB,
            free_vram_bytes=int(doc["vram_mib"]) * MIB,
            bandwidth_gbs=float(doc["bandwidth_gbs"]),
            pcie_gbs=float(doc["pcie_gbs"]),
            compute_capability=str(doc["compute_capability"]),
            fp16_tflops=float(doc["fp16_tflops"]),
            overhead_bytes=int(doc["overhead_mib"]) * MIB,
            decode_efficiency=float(doc["decode_efficiency"]),
            ram_bytes=int(float(host["ram_gib"]) * GIB),
            cores=int(host["cores"]),
            host_bandwidth_gbs=float(host["bandwidth_gbs"]),
            n_gpus=1 if has_gpu else 0,
            nvml_names=tuple(str(n) for n in doc.get("nvml_names", ())),
            disk_read_gbs=float(host.get("disk_gbs", 0.0)),
        )
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise CardError(f"card profile {path} is invalid: {e}") from None


def _several(name: str, doc: dict, base: Card) -> Card:
    """A profile `base = "rtx3090"`, `gpus = 2`: that many of the base card, with the label
    and [host] of this profile."""
    count = int(doc["gpus"])
    if count < 1 or not base.has_gpu:
        raise ValueError(f"gpus must be at least 1 and base a GPU profile, not {base.name!r}")
    host = doc.get("host", {})
    gpus = tuple(replace(base.gpu_list[0], device=f"CUDA{i}") for i in range(count))
    return replace(
        base, name=name, label=str(doc.get("label", f"{count} x {base.label}")), n_gpus=count,
        gpus=gpus,
        ram_bytes=int(float(host.get("ram_gib", base.ram_bytes / GIB)) * GIB),
        cores=int(host.get("cores", base.cores)),
        host_bandwidth_gbs=float(host.get("bandwidth_gbs", base.host_bandwidth_gbs)),
        disk_read_gbs=float(host.get("disk_gbs", base.disk_read_gbs)),
    )


def join_cards(cards: list[Card], name: str) -> Card:
    """One box holding the GPUs of every card in order (the host, PCIe, overhead and decode
    efficiency of the first); the per-card fields above the GPU list are the first GPU's."""
    gpus = [g for c in cards for g in c.gpu_list]
    if not gpus:
        raise CardError(f"card {name!r} has no GPU")
    gpus = [replace(g, device=f"CUDA{i}") for i, g in enumerate(gpus)]
    first = next(c for c in cards if c.has_gpu)
    return replace(first, name=name, label=" + ".join(c.label for c in cards if c.has_gpu),
                   vram_bytes=gpus[0].vram_bytes, n_gpus=len(gpus),
                   free_vram_bytes=min(g.free_vram_bytes for g in gpus), gpus=tuple(gpus),
                   ram_bytes=cards[0].ram_bytes, cores=cards[0].cores,
                   host_bandwidth_gbs=cards[0].host_bandwidth_gbs)


def match_card(device_name: str, total_bytes: int, directory: Path = CARDS_DIR) -> str | None:
    """The profile whose NVML name is `device_name` and whose memory is closest to the card's.

    GeForce names carry no memory size (an RTX 3080 has 10 or 12 GB, a 4060 Ti 8 or 16), so
    the memory decides between profiles that share a name; a card more than 15% away from every
    profile of its name matches none (a 4060 Ti 8 GB is not the 16 GB profile).
    """
    best: tuple[float, str] | None = None
    wanted = device_name.strip().lower()
    for name in card_names(directory):
        card = load_card(name, directory)
        if card.n_gpus != 1 or not card.vram_bytes \
                or wanted not in (n.lower() for n in card.nvml_names):
            continue
        distance = abs(card.vram_bytes - total_bytes) / card.vram_bytes
        if distance <= 0.15 and (best is None or distance < best[0]):
            best = (distance, name)
    return best[1] if best else None
