"""Planning across machines: the local card, RPC workers (`localllm worker`) and RAM.

    plan_with_workers(shape, card, request, workers, local) -> Plan

The local plan (the tuner's, for this card alone) keeps its context, KV type and local GPU
layers. The layers it leaves in RAM move to the workers, up to each one's reported free memory,
in proportion to it; what does not fit stays in RAM. A worker on which its layers would cost
more per token than in RAM (its speed and network counted) is left out, unless the request's
num_gpu asks for the layers off the CPU. llama.cpp lays layers out as: the first
ones on the CPU, then the devices of `model_params.devices` in order (the workers first, then the
local GPUs, which so keep the output layer and its logits on this machine); `tensor_split` holds
a layer count per device, so the split is exact (llama.cpp cuts at count / total).

Decode speed with the network in it: a token crosses each worker twice (its hidden state in and
out, n_embd float32 values each way) and waits for about two round trips per worker (the graph
and the result); a worker's layers take their bytes over the weight-reading speed measured on
it (engine/rpc.py; RPC does not report the hardware, so a worker that could not
be measured is taken as fast as this machine's card, or RAM). The local plan's prediction
covers the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from localllm.modelstore.shape import ModelShape

from localllm.planner.budgets import ram_budget
from localllm.planner.card import GIB, MIB, Card
from localllm.planner.costs import model_costs
from localllm.planner.memory import ContextSettings, block_kv_bytes
from localllm.planner.plan import DeviceMemory, Plan, cpu_plan, layer_ranges
from localllm.planner.search import NoPlanFits, Request
from localllm.engine.probes import Worker, WorkerError
from .workers import probe_workers

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


@dataclass(frozen=True)
class _Layout:
    """One way of spreading the host's layers over a set of workers, and its cost per token."""

    active: list[Worker]
    remote: list[RemoteDevice]
    counts: list[int]  # layers per remote device
    n_cpu: int  # layers left in RAM
    token_s: float
    gains: dict[str, float]  # per worker: seconds per token saved over RAM (negative: lost)


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
    host_bw = card.host_bandwidth_gbs * 1e9
    assumed_bw = (card.bandwidth_gbs * card.decode_efficiency * 1e9) if card.has_gpu else host_bw
    if local.predicted_decode_tps:
        local_s = 1 / local.predicted_decode_tps
    else:  # no local prediction (the model does not fit here alone): its RAM part, by bytes
        local_s = (sum(layer_bytes[:on_host]) + costs.embedding_bytes) / host_bw
    hidden = costs.n_embd * HIDDEN_BYTES_PER_VALUE

    def layout(active: list[Worker]) -> _Layout:
        remote = remote_devices(active)
        biggest = max(layer_bytes[:on_host] or [0])
        room = [max(0, d.free_bytes - WORKER_RESERVE_BYTES) for d in remote]
        capacity = [r // biggest if biggest else 0 for r in room]
        # Capacity counts the largest layer, so any layers fit in their device's room. They
        # go to the workers from the end of the host range (llama.cpp offloads the last ones).
        counts = _share(max(0, min(wanted - local_gpu, on_host)), capacity)
        n_cpu = on_host - sum(counts)
        # Per token: the local plan, with the moved layers at their worker's speed, plus the
        # network; and what each worker saves over keeping its layers in RAM.
        token_s = local_s - sum(layer_bytes[n_cpu:on_host]) / host_bw
        gains: dict[str, float] = {}
        first = n_cpu
        for d, k in zip(remote, counts, strict=True):
            moved = sum(layer_bytes[first:first + k])
            cost = moved / (d.worker.compute_bytes_per_s or assumed_bw)
            if k:
                cost += 2 * hidden / d.worker.link_bytes_per_s + 2 * d.worker.rtt_s
            token_s += cost
            gains[d.worker.endpoint] = gains.get(d.worker.endpoint, 0.0) + moved / host_bw - cost
            first += k
        return _Layout(active, remote, counts, n_cpu, token_s, gains)

    def ram_bytes(n_cpu: int) -> int:
        return sum(layer_bytes[:n_cpu]) + costs.embedding_bytes + costs.cpu_other_bytes

    plan_layout = layout(list(workers))
    dropped: list[str] = []
    # A worker slower than RAM for the layers it would take (its network included) is left
    # out, unless num_gpu asked for the layers off the CPU or RAM cannot take them back.
    while request.n_gpu_layers is None and plan_layout.active:
        endpoint, gain = min(plan_layout.gains.items(), key=lambda kv: kv[1])
        if gain >= 0:
            break
        fewer = layout([w for w in plan_layout.active if w.endpoint != endpoint])
        if ram_bytes(fewer.n_cpu) > ram_budget(card):
            break
        dropped.append(f"{endpoint} not used: its layers would cost {-gain * 1e3:.2f} ms more "
                       f"per token there than in RAM")
        plan_layout = fewer
    remote, counts, n_cpu = plan_layout.remote, plan_layout.counts, plan_layout.n_cpu
    n_remote = sum(counts)
    cpu_bytes = ram_bytes(n_cpu)
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
    # the local plan's own split over this machine's GPUs, where it has one
    local_split = {d: k for d, k in local.device_layers if d in gpus}
    if gpus and sum(local_split.values()) == local_gpu:
        per_gpu = [local_split.get(d, 0) for d in gpus]
    else:
        per_gpu = [local_gpu // len(gpus) + (1 if i < local_gpu % len(gpus) else 0)
                   for i in range(len(gpus))] if gpus else []
    memory += [m for m in local.memory if m.device != "CPU"]
    split += list(zip(gpus, per_gpu, strict=True))
    used = [d for d, k in zip(remote, counts, strict=True) if k]
    network_s = sum(2 * hidden / d.worker.link_bytes_per_s + 2 * d.worker.rtt_s for d in used)
    decode = 1 / plan_layout.token_s if plan_layout.token_s > 0 else 0.0

    reasons = [f"{len(workers)} RPC worker(s) configured: layers the local plan leaves in RAM "
               f"go to them, in proportion to their free memory, where they run faster than "
               f"in RAM"]
    for w in workers:
        speed = (f"reads weights at {w.compute_bytes_per_s / 1e9:.0f} GB/s"
                 if w.compute_bytes_per_s else
                 f"speed not measured, taken as this machine's {'card' if card.has_gpu else 'RAM'}")
        reasons.append(f"{w.endpoint}: {w.free_bytes / GIB:.1f} GiB free, {speed}; link "
                       f"{w.link_bytes_per_s / 1e9:.2f} GB/s, round trip "
                       f"{w.rtt_s * 1e3:.2f} ms (measured)")
    reasons += dropped
    reasons.append("split: " + "; ".join(layer_ranges(split)) + " (the output layer counts as the "
                   "last layer; token embeddings stay on the CPU)")
    if n_remote < min(wanted - local_gpu, on_host) and plan_layout.active:
        reasons.append(f"{n_cpu} layers stay in RAM: the workers in use are full "
                       f"({WORKER_RESERVE_BYTES >> 20} MiB kept free on each)")
    reasons.append(f"network per token: {len(used)} worker(s) x (2 x {hidden} B hidden state + "
                   f"2 round trips) = {network_s * 1e3:.2f} ms; predicted decode "
                   f"{decode:.1f} tok/s (this machine alone: {local.predicted_decode_tps:.1f})")
    return replace(
        local,
        n_gpu_layers=n_remote + local_gpu,
        tensor_split=tuple(float(k) for _, k in split[1:]),
        rpc_workers=tuple(w.endpoint for w in plan_layout.active),
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
    # Workers take whole blocks: the local plan they start from must leave whole blocks in RAM.
    local_request = replace(request, n_gpu_layers=None, ffn_split=False)
    try:
        local = local_planner(shape, card, local_request)
    except NoPlanFits as e:  # too big for this machine alone: the workers may hold it
        trained = shape.context_length
        local = replace(cpu_plan(request.n_ctx or min(request.min_ctx, trained or request.min_ctx),
                                 trained),
                        reasons=(f"this machine alone cannot hold it: {e}",))
    return plan_with_workers(shape, card, request, workers, local)
