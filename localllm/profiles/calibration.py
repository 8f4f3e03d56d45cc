"""The calibration this machine keeps, `<config dir>/profiles/calibration.toml`: per card
what `localllm tune --measure` learned (factors on the speed model's bandwidths) and what
`--calibrate` measured (bandwidths), and under `[host]` the disk's read rate; `calibrated`
applies them to a card. Written by profiles.measure, profiles.calibrate and
profiles.host_prices (the RAM read rate by threads).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from localllm.planner.card import MIB, Card
from .saved import profiles_dir, read_tables, write_toml

HOST_KEY = "host"  # the calibration table of this machine's own figures (no card is so named)
READ_KEY = "read_gbs"  # under [host]: {"threads": GB/s} (host_prices.py)
READ_WHEN_KEY = "read_measured_at"
KERNEL_KEY = "expert_gbs"  # under [host]: {"Q4_K": {"threads": GB/s}} (engine/kernel_rates.py)
KERNEL_WHEN_KEY = "expert_measured_at"
# under [host]: what serving measured against the plans' prices (served_speed.py)
SERVED_FACTOR_KEYS = ("served_host_factor", "served_mapped_factor")  # as the Card's fields
SERVED_WHEN_KEY = "served_measured_at"
SERVED_FACTOR_RANGE = (0.25, 4.0)  # past these a plan's error is not the host's price
SERVED_FROM_KEY = "served_measured_on"
# under [host]: a GPU's per-process overhead as serving measured it (served_vram.py)
OVERHEAD_KEY = "served_gpu_overhead_mib"
MAX_OVERHEAD_BYTES = 8 << 30  # past this the figure is not one process's overhead


def calibration_file() -> Path:
    return profiles_dir() / "calibration.toml"


def load_calibration(path: Path | None = None) -> dict:
    return read_tables(path or calibration_file())


def update_host(fields: dict, path: Path | None = None, drop: tuple[str, ...] = ()) -> dict:
    """Set `fields` in the `[host]` table (this machine's own figures), less the keys in
    `drop`, and write the file; the table as written."""
    path = path or calibration_file()
    doc = load_calibration(path)
    entry = {k: v for k, v in doc.get(HOST_KEY, {}).items() if k not in drop} | fields
    doc[HOST_KEY] = entry
    write_toml(path, doc)
    return entry


def calibrated(card: Card, path: Path | None = None) -> Card:
    """The card with the factors `--measure` stored for it and, for this machine's probed
    card, the host's measured disk rate (a profile keeps its box's own; none: unchanged)."""
    doc = load_calibration(path)
    if card.source == "probe":
        card = with_measured_disk(card, doc.get(HOST_KEY, {}))
        if card.has_gpu:  # host_prices.py measures them on first use; serving, the factors
            host = doc.get(HOST_KEY, {})  # and the GPU's overhead (served_vram.py)
            card = replace(card, host_read_gbs=stored_reads(host),
                           host_expert_gbs=stored_kernels(host), **served_factors(host),
                           overhead_bytes=max(card.overhead_bytes, stored_overhead(host)))
    factors = doc.get(card.name, {})
    try:
        gpu = float(factors.get("gpu_bandwidth_factor", 1.0))
        host = float(factors.get("host_bandwidth_factor", 1.0))
    except (TypeError, ValueError, OverflowError):
        return card
    card = with_measured_bandwidth(card, factors)  # from --calibrate, when it ran
    if not (0.01 <= gpu <= 100 and 0.01 <= host <= 100):
        return card
    return replace(card, decode_efficiency=card.decode_efficiency * gpu,
                   host_bandwidth_gbs=card.host_bandwidth_gbs * host)


def stored_overhead(host: dict) -> int:
    """The GPU overhead a `[host]` table keeps, in bytes (0: none, or not a sane figure)."""
    try:
        mib = float(host.get(OVERHEAD_KEY, 0))
    except (TypeError, ValueError, OverflowError):
        return 0
    return int(mib * MIB) if 0 < mib * MIB <= MAX_OVERHEAD_BYTES else 0


def stored_reads(host: dict) -> tuple[tuple[int, float], ...]:
    """The read rates by thread count a `[host]` table holds (host_prices.py), checked; ()
    where none or any is not a sane figure."""
    return _rates(host.get(READ_KEY))


def stored_kernels(host: dict) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """The expert kernels' rates by ggml type a `[host]` table holds, each type's checked as
    stored_reads checks the read rates (a type with a bad figure is left out)."""
    table = host.get(KERNEL_KEY)
    if not isinstance(table, dict):
        return ()
    checked = ((str(name), _rates(rates)) for name, rates in sorted(table.items()))
    return tuple((name, rates) for name, rates in checked if rates)


def _rates(table) -> tuple[tuple[int, float], ...]:
    if not isinstance(table, dict):
        return ()
    rates = []
    for threads, gbs in table.items():
        try:
            t, rate = int(threads), float(gbs)
        except (TypeError, ValueError, OverflowError):
            return ()
        if not (0 < t <= 4096 and 0 < rate < 100_000):
            return ()
        rates.append((t, rate))
    return tuple(sorted(rates))


def served_factors(host: dict) -> dict[str, float]:
    """The Card fields of the served-speed factors a `[host]` table holds (served_speed.py),
    each checked (a factor past SERVED_FACTOR_RANGE is not a price: left out)."""
    out = {}
    low, high = SERVED_FACTOR_RANGE
    for key in SERVED_FACTOR_KEYS:
        try:
            value = float(host[key])
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if low <= value <= high:
            out[key] = value
    return out


def with_measured_disk(card: Card, host: dict) -> Card:
    """The card with the host's measured disk read rate, when one is stored."""
    try:
        value = float(host["disk_read_gbs"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return card
    return replace(card, disk_read_gbs=value) if 0 < value < 1000 else card


def with_measured_bandwidth(card: Card, factors: dict) -> Card:
    """The card with measured bandwidths in place of the theoretical ones, when stored."""
    changes = {}
    for key, field in (("memory_bandwidth_gbs", "bandwidth_gbs"), ("pcie_gbs", "pcie_gbs")):
        try:
            value = float(factors[key])
        except (KeyError, TypeError, ValueError, OverflowError):
            continue
        if 0 < value < 100_000:
            changes[field] = value
    if "bandwidth_gbs" in changes and card.gpus:  # the GPUs of the measured kind with it
        changes["gpus"] = tuple(
            replace(g, bandwidth_gbs=changes["bandwidth_gbs"])
            if g.bandwidth_gbs == card.bandwidth_gbs else g for g in card.gpus)
    return replace(card, **changes) if changes else card
