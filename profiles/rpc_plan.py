"""Planning across machines: the local card, RPC workers (`localllm worker`) and RAM.

    plan_with_workers(shape, card, request, workers, local) -> Plan

The local plan (the tuner's, for this card alone) keeps its context, KV type and local GPU
layers. The layers it leaves in RAM move to the workers, up to each one's reported free memory,
in proportion to it; what does not fit stays in RAM. llama.cpp lays layers out as: the first
ones on the CPU, then the devices of `model_params.devices` in order (the workers first, then the
local GPUs, which so keep the output layer and its logits on this machine); `tensor_split` holds
a layer count per device, so the split is exact (llama.cpp cuts at count / total).

Decode speed with the network in it: a token crosses each worker twice (its hidden state in and
out, n_embd float32 values each way) and waits for about two round trips per worker (the graph
and the result); a worker's layers take their bytes over the weight-reading speed measured on
it (profiles.rpc; RPC does not report the hardware, so a worker that could not be measured is
taken as fast as this machine's card, or RAM). The local plan's prediction covers the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from localllm.modelstore.shape import ModelShape

from .card import GIB, MIB, Card
from .memory import ContextSettings, block_kv_bytes, model_costs
from .plan import DeviceMemory, Plan, cpu_plan
from .rpc import Worker, WorkerError, probe_workers
from .tuner import NoPlanFits, Request, ram_budget

log = logging.getLogger(__name__)
HIDDEN_BYTES_PER_VALUE = 4  # llama.cpp passes the hidden state between devices as float32
WORKER_RESERVE_BYTES = 512 * MIB  # left free on each worker device: compute buffers, driver


@dataclass(frozen=True)
class RemoteDevice:
    name: str  # "RPC[host:port]" (with "#i" for a worker's second device on)
    worker: Worker
    free_bytes: int


def remote_devices(workers: list[Worker]) -> list[RemoteDevice]:
    """The workers' devices in llama.cpp's order (the order the workers are configured)."""
    out = []
    for w in workers:
        for d in w.devices:
            suffix = f"#{d.index}" if len(w.devices) > 1 else ""
            out.append(RemoteDevice(f"RPC[{w.endpoint}]{suffix}", w, d.free_bytes))
    return out


def _share(total: int, capacities: list[int]) -> list[int]:
    """`total` layers over devices in proportion to capacity, none past its capacity."""
    counts = [0] * len(capacities)
    for _ in range(min(total, sum(capacities))):
        # the device with the most room left, relative to its size
        i = max(range(len(capacities)),
                key=lambda k: (capacities[k] - counts[k]) / capacities[k] if capacities[k] else -1)
        counts[i] += 1
    return counts


def _ranges(counts: list[tuple[str, int]]) -> list[str]:
    out, first = [], 0
    for device, n in counts:
        if n:
            out.append(f"{device}: layers {first}-{first + n - 1} ({n})")
        first += n
    return out


def plan_with_workers(shape: ModelShape, card: Card, request: Request, workers: list[Worker],
                      local: Plan) -> Plan:
    """`local` re-planned so the workers hold what the local card cannot; NoPlanFits when even
    with them the rest does not fit in RAM."""
    costs = model_costs(shape)
    n = costs.n_blocks
    settings = ContextSettings(local.n_ctx, local.type_k, local.type_v, local.flash_attn,
                               local.n_ubatch, local.swa_full, local.n_parallel)
    # llama.cpp's "layers": the n blocks, then the output layer (lm-head + final norm).
    layer_bytes = [costs.block_bytes[i] + costs.expert_bytes[i] + block_kv_bytes(costs, i, settings)
                   for i in range(n)] + [costs.output_bytes + costs.output_norm_bytes]
    local_gpu = min(local.n_gpu_layers, n + 1) if card.has_gpu else 0
    wanted = n + 1 if request.n_gpu_layers is None else min(request.n_gpu_layers, n + 1)
    local_gpu = min(local_gpu, wanted)
    on_host = n + 1 - local_gpu  # layers the local plan leaves in RAM
    remote = remote_devices(workers)
    biggest = max(layer_bytes[:on_host] or [0])
    room = [max(0, d.free_bytes - WORKER_RESERVE_BYTES) for d in remote]
    capacity = [r // biggest if biggest else 0 for r in room]
    # Capacity counts the largest layer, so any layers fit in their device's room. They go to
    # the workers from the end of the host range (llama.cpp offloads the last layers).
    counts = _share(max(0, min(wanted - local_gpu, on_host)), capacity)
    n_remote = sum(counts)
    n_cpu = on_host - n_remote
    cpu_bytes = sum(layer_bytes[:n_cpu]) + costs.embedding_bytes + costs.cpu_other_bytes
    if cpu_bytes > ram_budget(card):
        raise NoPlanFits(
            f"with the RPC workers, {n_cpu} layers still need {cpu_bytes / GIB:.1f} GiB of RAM "
            f"and {ram_budget(card) / GIB:.1f} GiB are usable; add a worker or use a smaller "
            f"model or context")

    # Per-device memory: weights and KV of each device's layers.
    memory = [DeviceMemory("CPU", weights=cpu_bytes, overhead=0)]
    first = n_cpu
    split: list[tuple[str, int]] = [("CPU", n_cpu)]
    for d, k in zip(remote, counts, strict=True):
        w = sum(costs.block_bytes[i] + costs.expert_bytes[i] for i in range(first, first + k)
                if i < n)
        kv = sum(block_kv_bytes(costs, i, settings) for i in range(first, first + k) if i < n)
        memory.append(DeviceMemory(d.name, weights=w, kv=kv))
        split.append((d.name, k))
        first += k
    gpus = list(card.devices)
    per_gpu = [local_gpu // len(gpus) + (1 if i < local_gpu % len(gpus) else 0)
               for i in range(len(gpus))] if gpus else []
    memory += [m for m in local.memory if m.device != "CPU"]
    split += list(zip(gpus, per_gpu, strict=True))

    # Speed: the local plan, with the moved layers at their worker's speed plus the network.
    host_bw = card.host_bandwidth_gbs * 1e9
    assumed_bw = (card.bandwidth_gbs * card.decode_efficiency * 1e9) if card.has_gpu else host_bw
    if local.predicted_decode_tps:
        local_s = 1 / local.predicted_decode_tps
    else:  # no local prediction (the model does not fit here alone): its RAM part, by bytes
        local_s = (sum(layer_bytes[:on_host]) + costs.embedding_bytes) / host_bw
    token_s = local_s - sum(layer_bytes[n_cpu:on_host]) / host_bw
    first = n_cpu
    for d, k in zip(remote, counts, strict=True):
        token_s += sum(layer_bytes[first:first + k]) / (d.worker.compute_bytes_per_s
                                                         or assumed_bw)
        first += k
    hidden = costs.n_embd * HIDDEN_BYTES_PER_VALUE
    used = [(d, k) for d, k in zip(remote, counts, strict=True) if k]
    network_s = sum(2 * hidden / d.worker.link_bytes_per_s + 2 * d.worker.rtt_s for d, _ in used)
    token_s += network_s
    decode = 1 / token_s if token_s > 0 else 0.0

    reasons = [f"{len(workers)} RPC worker(s) configured: layers the local plan leaves in RAM "
               f"go to them, in proportion to their free memory"]
    for w in workers:
        speed = (f"reads weights at {w.compute_bytes_per_s / 1e9:.0f} GB/s"
                 if w.compute_bytes_per_s else
                 f"speed not measured, taken as this machine's {'card' if card.has_gpu else 'RAM'}")
        reasons.append(f"{w.endpoint}: {w.free_bytes / GIB:.1f} GiB free, {speed}; link "
                       f"{w.link_bytes_per_s / 1e9:.2f} GB/s, round trip "
                       f"{w.rtt_s * 1e3:.2f} ms (measured)")
    reasons.append("split: " + "; ".join(_ranges(split)) + " (the output layer counts as the "
                   "last layer; token embeddings stay on the CPU)")
    if n_remote < min(wanted - local_gpu, on_host):
        reasons.append(f"{n_cpu} layers stay in RAM: the workers are full "
                       f"({WORKER_RESERVE_BYTES >> 20} MiB kept free on each)")
    reasons.append(f"network per token: {len(used)} worker(s) x (2 x {hidden} B hidden state + "
                   f"2 round trips) = {network_s * 1e3:.2f} ms; predicted decode "
                   f"{decode:.1f} tok/s (this machine alone: {local.predicted_decode_tps:.1f})")
    return replace(
        local,
        n_gpu_layers=n_remote + local_gpu,
        tensor_split=tuple(float(k) for _, k in split[1:]),
        rpc_workers=tuple(w.endpoint for w in workers),
        device_layers=tuple(split),
        memory=tuple(memory),
        predicted_decode_tps=round(decode, 2),
        reasons=(*local.reasons, *reasons),
        source="tuner+rpc",
    )


def plan_for_workers(shape: ModelShape, card: Card, request: Request, endpoints: tuple[str, ...],
                     local_planner: Callable[[ModelShape, Card, Request], Plan]) -> Plan:
    """The daemon's plan when rpc_workers is set: probe them, plan this machine alone with
    `local_planner` (the tuner), then spread over the workers. Workers that cannot be probed
    are reported in the plan's reasons and the log, and the model is planned without them."""
    try:
        workers = probe_workers(endpoints)
    except WorkerError as e:
        log.warning("RPC workers not used: %s", e)
        plan = local_planner(shape, card, request)
        return replace(plan, reasons=(*plan.reasons, f"RPC workers not used: {e}"))
    local_request = replace(request, n_gpu_layers=None)
    try:
        local = local_planner(shape, card, local_request)
    except NoPlanFits as e:  # too big for this machine alone: the workers may hold it
        trained = shape.context_length
        local = replace(cpu_plan(request.n_ctx or min(4096, trained or 4096), trained),
                        reasons=(f"this machine alone cannot hold it: {e}",))
    return plan_with_workers(shape, card, request, workers, local)
