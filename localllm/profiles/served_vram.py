"""A runner's GPU memory as it serves, against what its plan counted (issue #65).

A plan counts each GPU's weights, KV, compute buffers and an overhead: the card profile's CUDA
context, ggml-cuda's pool of kernel temporaries and the page tables of registered RAM. What the
process really holds beyond its buffers is the context plus the kernels loaded as they are first
used, and those stay: on an H100 it was 851 MiB after short answers and 1,069 after a 15K-token
prompt, where the profile said 600 and the plans ended 60-87 MiB past their totals
(lab/runs/h100-2026-12-07b-moe-ways.md). No probe sees it before the model has served.

So after an answer the daemon reads the runner's memory on its GPU (NVML, per process) and,
where it holds more than its plan counted, keeps this machine's overhead raised by the
difference (calibration.toml's `[host]`, `OVERHEAD_KEY`); `calibration.calibrated` gives the
probed card the larger of its profile's and this, so every later plan on the machine counts it.
Only single-GPU plans are read: a process's figure on several GPUs is not one plan's device.
"""

from __future__ import annotations

import time

from localllm.planner.card import MIB
from localllm.planner.plan import Plan

from .calibration import MAX_OVERHEAD_BYTES, OVERHEAD_KEY, update_host

OVERHEAD_WHEN_KEY = "served_gpu_overhead_at"
MIN_OVER_BYTES = 8 * MIB  # NVML's rounding and a stray allocation are not a price


def planned_gpu_bytes(plan: Plan) -> int:
    """What the plan counted on its one GPU (0: it has none, or several)."""
    gpus = [m for m in plan.memory if m.device != "CPU"]
    return gpus[0].total if len(gpus) == 1 else 0


def overhead_from(plan: Plan, used_bytes: int, card_overhead: int) -> int | None:
    """The GPU overhead a runner of `plan` showed, holding `used_bytes` where the plan counted
    `card_overhead` for its context; None where it held no more than its plan said."""
    planned = planned_gpu_bytes(plan)
    if not planned or used_bytes - planned < MIN_OVER_BYTES:
        return None
    overhead = card_overhead + used_bytes - planned
    return overhead if overhead <= MAX_OVERHEAD_BYTES else None


def store(overhead: int, current: int, path=None) -> bool:
    """Keep `overhead` for this machine's GPUs where it is above `current` (what the planner
    counts now); whether it was written."""
    if overhead <= current:
        return False
    update_host({OVERHEAD_KEY: round(overhead / MIB, 1),
                 OVERHEAD_WHEN_KEY: time.strftime("%Y-%m-%dT%H:%M:%S%z")}, path)
    return True
