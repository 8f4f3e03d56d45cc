"""Plans past RAM: weights that fit neither in VRAM nor in RAM are read from disk through mmap.

llama.cpp maps the GGUF (use_mmap) and its CPU-resident weights are page cache: the kernel keeps
what RAM holds and reads the rest from the file again each time a token needs it. So a plan
whose CPU weights exceed the RAM budget still runs, at the disk's read rate for the excess.

The page cache alone does not keep as much of the weights as the RAM budget leaves: decode reads
them in the same order every token, and LRU evicts each page just before it is needed again, so
nearly all of the CPU's weights would be read per token. The runner therefore locks the part
the budget holds (engine/resident.py) and only the excess cycles through the cache; where mlock
is not allowed that far, decode is slower than predicted and the runner says so. For a mixture
of experts only the routed experts are read per token, so only that share of the excess comes
from disk.

The read rate is the host's, measured by `localllm tune --calibrate` (profiles.calibrate) and
stored with the other calibration figures; without a measurement a conservative NVMe figure is
assumed and the plan says so.
"""

from __future__ import annotations

from dataclasses import replace

from .card import Card
from .memory import CPU
from .plan import DeviceMemory
from .speed import Speed

# A PCIe 3.0 NVMe drive reads 2-3.5 GB/s sequentially; page faults through mmap reach less.
ASSUMED_DISK_GBS = 1.5


def disk_bytes_per_token(memory: tuple[DeviceMemory, ...], ram_budget: int,
                         read_fraction: float = 1.0) -> int:
    """Bytes of weights read from disk per token: the CPU's weights beyond what the RAM budget
    leaves them after KV and compute buffers (those are not file-backed and must fit), times
    the share of those weights a token reads (1 for dense models)."""
    cpu = next((m for m in memory if m.device == CPU), None)
    if cpu is None:
        return 0
    excess = min(cpu.weights, max(0, cpu.total - ram_budget))
    return int(excess * read_fraction)


def non_weight_ram_fits(memory: tuple[DeviceMemory, ...], ram_budget: int) -> bool:
    """KV and compute buffers in RAM are allocated, not mapped: they must fit whatever spills."""
    return all(m.total - m.weights <= ram_budget for m in memory if m.device == CPU)


def disk_read_gbs(card: Card) -> tuple[float, bool]:
    """(GB/s, measured?) for the host's disk."""
    if card.disk_read_gbs and card.disk_read_gbs > 0:
        return card.disk_read_gbs, True
    return ASSUMED_DISK_GBS, False


def with_disk_reads(speed: Speed, disk_bytes: int, card: Card, n_ubatch: int) -> Speed:
    """The speed with the disk's part added: every token reads `disk_bytes` at the disk's rate,
    and so does every prompt batch (op offload copies CPU weights to the GPU per batch)."""
    if disk_bytes <= 0:
        return speed
    seconds = disk_bytes / (disk_read_gbs(card)[0] * 1e9)
    decode = 1.0 / (1.0 / speed.decode_tps + seconds) if speed.decode_tps > 0 else 0.0
    prefill = (n_ubatch / (n_ubatch / speed.prefill_tps + seconds)
               if speed.prefill_tps > 0 else 0.0)
    return replace(speed, decode_tps=decode, prefill_tps=prefill,
                   decode_seconds_cpu=speed.decode_seconds_cpu + seconds)


def disk_reason(disk_bytes: int, card: Card) -> str:
    rate, measured = disk_read_gbs(card)
    how = ("assumed" if not measured else "the card profile's figure"
           if card.source.startswith("profile") else "measured by tune --calibrate")
    return (f"{disk_bytes / (1 << 30):.1f} GiB read from disk per token at {rate:.1f} GB/s "
            f"({how}): the weights exceed VRAM plus the RAM budget, so the rest stays mmapped "
            "in the model file (use_mmap) and decode waits on the disk; the runner locks the "
            "part RAM holds (mlock), so that the page cache cannot evict it for the rest, and "
            "loads the CPU's weights unrepacked, as the file's pages")
