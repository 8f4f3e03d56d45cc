"""Plan: every parameter the runner loads a model with, with the predicted cost and the reasons.

The runner only ever sees a Plan; the tuner (profiles.choose) makes them. `cpu_plan`
holds the safe all-CPU defaults the tuner starts from on a machine without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from localllm.speculative import AUTO, MAX_DRAFT, Mode, current_name, mode


@dataclass(frozen=True)
class TensorOverride:
    pattern: str  # regex searched in tensor names, as llama.cpp's -ot
    device: str  # "CPU", "CUDA0", ...


@dataclass(frozen=True)
class DeviceMemory:
    device: str  # "CUDA0" or "CPU"
    weights: int = 0
    kv: int = 0
    compute: int = 0
    overhead: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.overhead


@dataclass(frozen=True)
class Plan:
    n_ctx: int
    n_gpu_layers: int = 0
    tensor_overrides: tuple[TensorOverride, ...] = ()
    tensor_split: tuple[float, ...] = ()
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = False
    swa_full: bool = False
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 1
    n_threads_batch: int = 1
    use_mmap: bool = True
    # With use_mmap on a GPU: the mapped weights that stay in RAM are pinned for the GPU where
    # the file maps them (engine/host_pin.py), so a prompt's micro-batches copy them at PCIe speed
    # without a second, pinned copy of them. The runner falls back to that copy (use_mmap off)
    # when the driver refuses.
    pin_in_place: bool = False
    # llama.cpp's extra buffer types (weights repacked for the CPU's kernels, AMX): off when the
    # engine crashed with them on this CPU (the daemon's retry, issue #32); past RAM they are
    # off whatever this says (engine/params.py)
    extra_bufts: bool = True
    # Past RAM: bytes of the CPU's weights that RAM does not hold, read from the model file as
    # each token needs them. The runner locks the rest in RAM so they stay (engine/resident.py).
    streamed_bytes: int = 0
    n_parallel: int = 1  # slots: sequences decoded together, each with n_ctx of KV
    # MoE: experts the engine's expert cache holds (patches/0002, planner/
    # expert_pool.py), a pool the target context alone gets; 0: off
    expert_cache: int = 0
    # With a pool on a GPU: its misses computed by the GPU from the experts where they lie in
    # pinned RAM (patches/0003: a decode step never passes through the CPU), not by the CPU
    expert_misses_on_gpu: bool = False
    # experts the pool may take in after a step, replacing colder ones (expert_pool.
    # swaps_per_step: more for a bigger pool, so that any pool warms in about as many steps);
    # 0: the engine's default, 4
    expert_cache_swaps: int = 0
    # where the pool goes: "gpu" (the first GPU) or "cpu" (in RAM: config expert_cache_device
    # = cpu, for tests and development on a machine without a GPU; it gains no speed)
    expert_cache_device: str = "gpu"
    # the hit rate that pool was priced with (expert_pool.py; 0.0: no pool); the scheduler
    # plans again once the pool's measured rate is far from it
    expected_hit_rate: float = 0.0
    # The ways `auto` weighed for the experts (planner/ways.py) where their prices were too
    # close to trust: this plan's way, each way's (name, predicted tok/s, tok/s measured here
    # or 0), and what they were measured under (card, free VRAM, context). The daemon stores
    # what the plan's way decodes serving, and plans again while a way is unmeasured.
    way: str = ""
    ways: tuple[tuple[str, float, float], ...] = ()
    ways_key: str = ""
    # Speculative decoding: "off", "lookup" (n-grams of the prompt), "mtp" (the model's NextN
    # layers) or "draft" (the paired draft model). A profile's "prompt-lookup" reads as "lookup",
    # "none" (the name before requests and plans shared one vocabulary) as "off".
    speculative: str = "off"
    draft_n_max: int = 0  # the longest draft; the runner adapts below it (0: the mode's default)
    draft_n_gpu_layers: int = 0  # the draft model's layers on the GPU (llama.cpp's -ngld)
    # RPC workers ("host:port") whose devices come before the local GPUs in llama.cpp's device
    # list; tensor_split counts over that list (profiles.rpc_plan makes such plans).
    rpc_workers: tuple[str, ...] = ()
    # Layers per device ("CPU", "RPC[host:port]#0", "CUDA0"; the output layer counted), for ps.
    device_layers: tuple[tuple[str, int], ...] = ()
    # NVML indices (PCI bus order) of the GPUs that CUDA0, CUDA1... are: the runner's
    # CUDA_VISIBLE_DEVICES, so that a `gpus` setting or a probe's view holds; empty: as the
    # daemon's environment has them (a profile planned on another machine)
    gpus: tuple[int, ...] = ()
    # A vision model's projector (mmproj): on the GPU with the layers, or on the CPU when the
    # card is short (each image then costs predicted_image_s there).
    projector_on_gpu: bool = True
    predicted_image_s: float = 0.0
    memory: tuple[DeviceMemory, ...] = ()
    predicted_prefill_tps: float = 0.0
    predicted_decode_tps: float = 0.0  # averaged over the expected fill of the context
    predicted_plain_decode_tps: float = 0.0  # the same without speculative decoding (0: unknown)
    predicted_decode_by_depth: tuple[tuple[int, float], ...] = ()  # (tokens in context, tok/s)
    # Time to the first token of a prompt read into an empty context: (prompt tokens, seconds)
    predicted_ttft: tuple[tuple[int, float], ...] = ()
    workload: str = ""  # the session the plan was made for (planner.workload)
    workload_source: str = ""  # where that came from: learned from N requests, a route, config
    predicted_session_s: float = 0.0  # that session's predicted time, prompts and answers
    reasons: tuple[str, ...] = ()
    source: str = "default"  # "default", "tuner", "profile:<path>"

    def load_key(self) -> tuple:
        """What forces a reload when it changes (predictions and reasons do not)."""
        return (self.n_ctx, self.n_gpu_layers, self.tensor_overrides, self.tensor_split,
                self.type_k, self.type_v, self.flash_attn, self.swa_full, self.n_batch,
                self.n_ubatch, self.n_threads, self.n_threads_batch, self.use_mmap,
                self.pin_in_place,
                self.extra_bufts, self.streamed_bytes,
                self.n_parallel, self.expert_cache, self.expert_misses_on_gpu,
                self.expert_cache_swaps, self.expert_cache_device,
                self.speculative, self.draft_n_max, self.draft_n_gpu_layers,
                self.rpc_workers, self.projector_on_gpu, self.gpus)

    @property
    def draft_mode(self) -> Mode:
        """The row of the plan's speculative mode (localllm.speculative); UnknownMode (a
        ValueError) for a name no mode has."""
        return mode(self.speculative)

    def draft_ceiling(self) -> int:
        """The longest draft the plan's drafter may propose: draft_n_max, else the mode's
        default, never past MAX_DRAFT; 0 when the plan does not draft."""
        row = self.draft_mode
        return min(self.draft_n_max or row.default_draft, MAX_DRAFT) if row.drafts else 0

    def rollback_positions(self) -> int:
        """How many positions a recurrent state must be able to take back (rejected drafts):
        llama.cpp keeps that many snapshots of it per sequence (n_rs_seq), and the tuner
        prices them (profiles.choose.settings_of)."""
        ceiling = self.draft_ceiling()
        return ceiling + 1 if ceiling else 0

    def request_mode(self, asked: str) -> str:
        """The mode a request's `speculative` option means on this plan: `auto` is the plan's
        own. The daemon resolves it before the runner sees the request."""
        return self.speculative if asked == AUTO else asked

    def vram_bytes(self) -> int:
        return sum(m.total for m in self.memory if m.device != "CPU")

    def ram_bytes(self) -> int:
        return sum(m.total for m in self.memory if m.device == "CPU")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        data["tensor_overrides"] = tuple(TensorOverride(**o)
                                         for o in data.get("tensor_overrides", ()))
        data["memory"] = tuple(DeviceMemory(**m) for m in data.get("memory", ()))
        for key in ("tensor_split", "reasons", "rpc_workers", "gpus"):
            data[key] = tuple(data.get(key, ()))
        for key in ("predicted_decode_by_depth", "predicted_ttft"):
            data[key] = tuple((int(d), float(t)) for d, t in data.get(key, ()))
        data["device_layers"] = tuple((str(d), int(n)) for d, n in data.get("device_layers", ()))
        data["ways"] = tuple((str(w), float(p), float(m)) for w, p, m in data.get("ways", ()))
        if "speculative" in data:
            data["speculative"] = current_name(data["speculative"])
        return cls(**data)


def layer_ranges(device_layers: tuple[tuple[str, int], ...] | list[tuple[str, int]]) -> list[str]:
    """`CUDA0: layers 0-39 (40)` for each device that holds layers, in llama.cpp's order."""
    out, first = [], 0
    for device, n in device_layers:
        if n:
            out.append(f"{device}: layers {first}-{first + n - 1} ({n})")
        first += n
    return out


def physical_cores() -> int:
    """Physical cores (llama.cpp decodes fastest with one thread per core, not per SMT thread)."""
    try:
        seen = set()
        physical_id = core_id = None
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("physical id"):
                    physical_id = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core_id = line.split(":")[1].strip()
                elif not line.strip() and core_id is not None:
                    seen.add((physical_id, core_id))
                    physical_id = core_id = None
        if core_id is not None:
            seen.add((physical_id, core_id))
        if seen:
            return max(1, min(len(seen), len(os.sched_getaffinity(0))))
    except OSError:
        pass
    return max(1, (os.cpu_count() or 2) // 2)


def cpu_plan(n_ctx: int, trained_ctx: int = 0) -> Plan:
    """Safe defaults: everything on the CPU, one thread per physical core."""
    ctx = min(n_ctx, trained_ctx) if trained_ctx else n_ctx
    threads = physical_cores()
    reasons = [f"all layers on the CPU (no tuned plan); {threads} threads = physical cores"]
    if trained_ctx and n_ctx > trained_ctx:
        reasons.append(f"context capped at the trained {trained_ctx} (asked {n_ctx})")
    return Plan(
        n_ctx=ctx,
        flash_attn=True,  # faster on the CPU as well (see tuner.search)
        n_batch=min(512, ctx),
        n_ubatch=min(512, ctx),
        n_threads=threads,
        n_threads_batch=os.cpu_count() or threads,
        reasons=tuple(reasons),
    )
