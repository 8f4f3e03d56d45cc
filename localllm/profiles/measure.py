"""`localllm tune --measure`: load a plan for real, time prefill and decode, read VRAM from NVML,
and turn the error of the speed model into a calibration for this card.

Calibration is per card name, in `<config dir>/profiles/calibration.toml`: a factor on the card's
decode bandwidth efficiency (GPU) and on the host's bandwidth (CPU blocks), applied whenever the
card is resolved. The factor goes to the side that took most of the predicted time.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import tomli_w

from localllm.errors import UserError

from localllm.planner.plan import Plan
from localllm.engine.probes import Measure, Measurement
from localllm.planner.speed import TOKEN_SECONDS
from .calibration import calibration_file, load_calibration
from localllm.engine.probing import ProbeFailed, ask


# What update_calibration writes (reset_calibration removes them).
_MEASURE_KEYS = ("gpu_bandwidth_factor", "host_bandwidth_factor", "measured_decode_tps",
                 "measured_at")


def update_calibration(card_name: str, gpu_seconds: float, cpu_seconds: float,
                       measured_decode_tps: float, path: Path | None = None) -> dict:
    """Blame the prediction's error on the side (GPU or host) that took most of its time."""
    path = path or calibration_file()
    doc = load_calibration(path)
    entry = dict(doc.get(card_name, {}))
    measured = 1.0 / measured_decode_tps - TOKEN_SECONDS
    if cpu_seconds >= gpu_seconds and cpu_seconds > 0:
        rest = measured - gpu_seconds
        if rest > 0:
            key = "host_bandwidth_factor"
            entry[key] = float(entry.get(key, 1.0)) * cpu_seconds / rest
    elif gpu_seconds > 0:
        rest = measured - cpu_seconds
        if rest > 0:
            key = "gpu_bandwidth_factor"
            entry[key] = float(entry.get(key, 1.0)) * gpu_seconds / rest
    entry["measured_decode_tps"] = round(measured_decode_tps, 2)
    entry["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    doc[card_name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(doc))
    return entry


def measure_in_child(model_path: str, plan: Plan, prompt_tokens: int = 128,
                     decode_tokens: int = 32, timeout: float = 600) -> Measurement:
    """The plan loaded for real in the engine's child program (engine/measure.py), so a CUDA
    context never stays in this process; `other_load` says how busy the rest of the machine
    kept the CPU meanwhile."""
    before = _cpu_seconds()
    try:
        measured = ask(Measure(model_path, plan, prompt_tokens, decode_tokens), timeout)
    except ProbeFailed as e:
        raise UserError(f"the benchmark load failed: {e}") from None
    after = _cpu_seconds()
    wall = after[0] - before[0]
    others = (after[1] - before[1]) - (after[2] - before[2])
    return replace(measured, other_load=round(max(0.0, others / wall), 2) if wall > 0 else 0.0)


def _cpu_seconds() -> tuple[float, float, float]:
    """(wall clock, CPU seconds every process on the machine spent busy (/proc/stat), CPU
    seconds of this process and its finished children); 0 busy where /proc is unreadable."""
    import os

    own = os.times()
    mine = own.user + own.system + own.children_user + own.children_system
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return time.monotonic(), mine, mine
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, mine


DOUBTFUL_RATIO = 0.5  # measured decode under half the prediction...
BUSY_CORES = 0.5  # ...while other processes kept this much CPU busy: not a figure to keep


def doubtful(measured: Measurement, predicted_decode_tps: float) -> str | None:
    """Why a measurement should not become the calibration (None: it may). A machine busy with
    other work measures the work, not the card: one such figure once made every plan predict
    2.3 tok/s for a model that decodes at 36."""
    if predicted_decode_tps <= 0 or measured.decode_tps >= DOUBTFUL_RATIO * predicted_decode_tps:
        return None
    if measured.other_load < BUSY_CORES:
        return None
    return (f"measured decode {measured.decode_tps:.1f} tok/s is far below the "
            f"{predicted_decode_tps:.1f} predicted, while other processes kept "
            f"{measured.other_load:.1f} CPU cores busy")


def reset_calibration(path: Path | None = None) -> list[str]:
    """Forget what `--measure` stored (the cards' speed factors); what `--calibrate` measured
    (bandwidths, the disk) stays. Returns the cards whose factors were removed."""
    from .saved import write_toml

    path = path or calibration_file()
    doc = load_calibration(path)
    reset = []
    for name, entry in doc.items():
        kept = {k: v for k, v in entry.items() if k not in _MEASURE_KEYS}
        if kept != entry:
            reset.append(name)
            doc[name] = kept
    if reset:
        write_toml(path, {k: v for k, v in doc.items() if v})
    return reset
