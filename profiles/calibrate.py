"""`localllm tune --calibrate`: measure the card's real memory and host-to-device bandwidth with
torch (the optional extra) and store them with the card's calibration.

Without torch the tuner uses the theoretical figures NVML gives (memory clock x bus width, PCIe
generation x width: see hardware.card_from_nvml); those are peaks no kernel reaches, which is
what the measured figures correct.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import tomli_w

from localllm.errors import UserError

from .card import Card
from .measure import calibration_file, load_calibration

GB = 1e9


@dataclass(frozen=True)
class Bandwidth:
    memory_gbs: float  # device memory, read + write of a device-to-device copy
    host_to_device_gbs: float  # pinned host memory to the device


def measure_bandwidth(device: int = 0, size_bytes: int = 1 << 30, repeats: int = 10) -> Bandwidth:
    """Best of `repeats` timed copies (CUDA events), after a warm-up."""
    try:
        import torch
    except ImportError:
        raise UserError("--calibrate needs torch: pip install 'localllm[torch]' (without it the "
                        "tuner uses NVML's theoretical bandwidth)") from None
    if not torch.cuda.is_available():
        raise UserError("--calibrate needs a CUDA GPU that torch can use; none was found")
    dev = torch.device("cuda", device)
    src = torch.empty(size_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    host = torch.empty(size_bytes // 4, dtype=torch.uint8, pin_memory=True)
    host_dst = torch.empty(size_bytes // 4, dtype=torch.uint8, device=dev)

    def best_seconds(copy) -> float:
        copy()
        torch.cuda.synchronize(dev)
        best = float("inf")
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        return best

    d2d = best_seconds(lambda: dst.copy_(src))
    h2d = best_seconds(lambda: host_dst.copy_(host, non_blocking=True))
    return Bandwidth(memory_gbs=2 * size_bytes / d2d / GB,
                     host_to_device_gbs=(size_bytes // 4) / h2d / GB)


def store_bandwidth(card_name: str, measured: Bandwidth, path: Path | None = None) -> dict:
    path = path or calibration_file()
    doc = load_calibration(path)
    entry = dict(doc.get(card_name, {}))
    entry["memory_bandwidth_gbs"] = round(measured.memory_gbs, 1)
    entry["pcie_gbs"] = round(measured.host_to_device_gbs, 1)
    entry["bandwidth_measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc[card_name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(doc))
    return entry


def with_measured_bandwidth(card: Card, factors: dict) -> Card:
    """The card with measured bandwidths in place of the theoretical ones, when stored."""
    changes = {}
    for key, field in (("memory_bandwidth_gbs", "bandwidth_gbs"), ("pcie_gbs", "pcie_gbs")):
        try:
            value = float(factors[key])
        except (KeyError, TypeError, ValueError):
            continue
        if 0 < value < 100_000:
            changes[field] = value
    return replace(card, **changes) if changes else card


def calibrate(card: Card) -> tuple[Bandwidth, Card]:
    """Measure in a child process: torch's CUDA runtime and llama.cpp's must not share one
    (seen: a process holding both aborted in free())."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "localllm.profiles.calibrate"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise UserError(lines[-1].removeprefix("Error: ") if lines else
                        f"the bandwidth measurement failed (exit {proc.returncode})")
    measured = Bandwidth(**json.loads(proc.stdout.strip().splitlines()[-1]))
    store_bandwidth(card.name, measured)
    return measured, with_measured_bandwidth(card, load_calibration()[card.name])


def main() -> int:
    import json
    import sys
    from dataclasses import asdict

    try:
        print(json.dumps(asdict(measure_bandwidth())))
    except UserError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
