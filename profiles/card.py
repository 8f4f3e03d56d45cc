"""Card: the GPU (or its absence) and the host a plan is made for, from a profile or a probe.

`profiles/cards/*.toml` describe the common cards so that any card can be planned for on any
machine (`localllm tune --card rtx3060-12g`); `localllm.llama.hardware.probe_card` fills the
same type from NVML and the OS.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

from localllm.errors import UserError

CARDS_DIR = Path(__file__).resolve().parent / "cards"
MIB = 1 << 20
GIB = 1 << 30
CPU_ONLY = "cpu-only"


class CardError(UserError):
    """An unknown card name or a card profile that cannot be read."""


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
    # "profile", "probe", or "profile+host" (the card from a profile, the host probed)
    source: str = "profile"
    # The host's disk read rate, GB/s, from `tune --calibrate` or a profile's [host] disk_gbs;
    # 0: not measured (plans past RAM assume profiles.disk.ASSUMED_DISK_GBS)
    disk_read_gbs: float = 0.0
    # RAM a model may take when probed: MemAvailable capped by the cgroup's memory.max
    # (llama/hardware.py ram_available); 0: not probed (plans count ram_bytes less a reserve)
    ram_available_bytes: int = 0

    @property
    def has_gpu(self) -> bool:
        return self.n_gpus > 0 and self.vram_bytes > 0

    @property
    def devices(self) -> tuple[str, ...]:
        """llama.cpp's device names for the GPUs, in order."""
        return tuple(f"CUDA{i}" for i in range(self.n_gpus if self.has_gpu else 0))

    def with_vram(self, gib: float) -> Card:
        """The same card with a smaller (or larger) memory: `--vram`, or a budget emulated on a
        bigger card. The usable part is what is free, so both move together."""
        total = int(gib * GIB)
        return replace(self, vram_bytes=total, free_vram_bytes=total,
                       label=f"{self.label}, {gib:g} GiB budget")

    def with_host(self, ram_bytes: int, cores: int, host_bandwidth_gbs: float) -> Card:
        return replace(self, ram_bytes=ram_bytes, cores=cores,
                       host_bandwidth_gbs=host_bandwidth_gbs,
                       source="profile+host" if self.source == "profile" else self.source)


def card_names(directory: Path = CARDS_DIR) -> list[str]:
    return sorted(p.stem for p in directory.glob("*.toml"))


def load_card(name: str, directory: Path = CARDS_DIR) -> Card:
    """The profile `cards/NAME.toml`; CardError names the known cards when NAME is not one."""
    path = directory / f"{name}.toml"
    if not path.is_file():
        raise CardError(f"unknown card {name!r}; known cards: {', '.join(card_names(directory))}")
    try:
        doc = tomllib.loads(path.read_text())
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
        if wanted not in (n.lower() for n in card.nvml_names) or not card.vram_bytes:
            continue
        distance = abs(card.vram_bytes - total_bytes) / card.vram_bytes
        if distance <= 0.15 and (best is None or distance < best[0]):
            best = (distance, name)
    return best[1] if best else None
