"""What the tuner asks the engine to measure: one frozen request per op, one typed result each.
They are ops of the engine's one child program, the runner (`python -m localllm.engine.runner`):
engine/runner/protocol.py's op table names each request, the result that answers it and the
function of engine/runner/tuner_ops.py that computes it; engine/probing.py asks.

    {"op": "dry_run", "id": "", ...the request's fields}    the child's first and only line in
    {"event": "chunks", "id": "", "done": 1, "total": 4}    any number out (Evaluate's progress)
    {"event": "buffers", "id": "", ...the result's fields}  or {"event": "error", "message": ...}

Values only: nothing here reads a file or starts a process, so planning may hold them and the
engine room may build them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import ClassVar

from localllm.errors import UserError

from localllm.planner.plan import Plan
from .kernel_rates import BUFFER_BYTES, TYPES  # constants only: nothing of ggml is loaded


class WorkerError(UserError):
    """An RPC worker that cannot be used: unreachable, busy, or a bad endpoint."""


# ---- results ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Buffers:
    """llama.cpp's own sizes for a plan, from a load that allocates nothing."""
    kind: ClassVar[str] = "buffers"
    compute: dict[str, int]  # compute buffer bytes per device ("CPU" for the host's)
    kv_bytes: int = 0
    state_bytes: int = 0  # recurrent state


@dataclass(frozen=True)
class Measurement:
    kind: ClassVar[str] = "measurement"
    prefill_tps: float
    decode_tps: float
    vram_bytes: int  # this process's GPU memory after the run (NVML), 0 without a GPU
    prompt_tokens: int
    decoded_tokens: int
    other_load: float = 0.0  # CPU cores other processes kept busy while it ran
    expert_cache: dict | None = None  # the expert pool's figures (engine/expert_cache.py)


@dataclass(frozen=True)
class EvalResult:
    setting: str  # "q8_0" (KV) or "f16" for the other model
    reference: str  # "f16" (KV of the same model) or the other model's name
    kl_mean: float
    kl_p99: float
    top_agreement: float  # fraction of scored tokens whose most likely next token agrees
    perplexity: float
    reference_perplexity: float
    n_tokens: int  # scored tokens


@dataclass(frozen=True)
class Evaluation:
    kind: ClassVar[str] = "evaluation"
    results: tuple[EvalResult, ...]

    @classmethod
    def from_wire(cls, data: dict) -> Evaluation:
        return cls(tuple(EvalResult(**r) for r in data["results"]))


@dataclass(frozen=True)
class WorkerDevice:
    endpoint: str  # "host:port"
    index: int  # device number on that worker
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Worker:
    """An RPC worker (`localllm worker`) as the planner sees it."""
    endpoint: str
    devices: tuple[WorkerDevice, ...]
    link_bytes_per_s: float  # measured: the slower of upload and download
    rtt_s: float  # measured: one command's round trip
    compute_bytes_per_s: float = 0.0  # measured: Q4_0 weights its device reads a second in a
    # matrix-vector chain (decode's work); 0 when it could not be measured

    @property
    def free_bytes(self) -> int:
        return sum(d.free_bytes for d in self.devices)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Worker:
        return cls(data["endpoint"], tuple(WorkerDevice(**d) for d in data["devices"]),
                   float(data["link_bytes_per_s"]), float(data["rtt_s"]),
                   float(data.get("compute_bytes_per_s", 0.0)))


@dataclass(frozen=True)
class Workers:
    kind: ClassVar[str] = "workers"
    workers: tuple[Worker, ...]

    @classmethod
    def from_wire(cls, data: dict) -> Workers:
        return cls(tuple(Worker.from_dict(w) for w in data["workers"]))


@dataclass(frozen=True)
class Bandwidth:
    kind: ClassVar[str] = "bandwidth"
    memory_gbs: float  # device memory, read + write of a device-to-device copy
    host_to_device_gbs: float  # pinned host memory to the device


@dataclass(frozen=True)
class KernelRates:
    """GB/s of expert weights ggml's CPU kernels multiply at decode (engine/kernel_rates.py)."""
    kind: ClassVar[str] = "kernel_rates"
    rates: tuple[tuple[str, int, float], ...]  # (ggml type, threads, GB/s)

    def by_type(self) -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {}
        for name, threads, gbs in self.rates:
            out.setdefault(name, {})[int(threads)] = float(gbs)
        return out


# ---- requests: one per op; `result` is the type that answers it ------------------------------


@dataclass(frozen=True)
class DryRun:
    """llama.cpp's buffers for a plan, the model and context built as the runner builds them."""
    model_path: str
    plan: Plan

    @classmethod
    def from_wire(cls, data: dict) -> DryRun:
        return cls(data["model_path"], Plan.from_dict(data["plan"]))


@dataclass(frozen=True)
class Measure:
    """`tune --measure`: the plan loaded for real, a prompt read and a greedy decode timed."""
    model_path: str
    plan: Plan
    prompt_tokens: int = 128
    decode_tokens: int = 32

    @classmethod
    def from_wire(cls, data: dict) -> Measure:
        return cls(data["model_path"], Plan.from_dict(data["plan"]), int(data["prompt_tokens"]),
                   int(data["decode_tokens"]))


@dataclass(frozen=True)
class Evaluate:
    """`localllm eval`: each KV setting (or the other model) against the reference, per chunk of
    `text` (profiles/evaluate.py says what is measured)."""
    model_path: str
    settings: tuple[str, ...]
    text: str
    n_ctx: int
    reference_path: str | None = None  # another file of the same model; None: f16 KV of this one
    reference_name: str = "f16"
    n_gpu_layers: int = 999

    @classmethod
    def from_wire(cls, data: dict) -> Evaluate:
        data = {k: v for k, v in data.items() if k not in ("op", "id")}
        return cls(**{**data, "settings": tuple(data["settings"])})


@dataclass(frozen=True)
class RpcProbe:
    """Each RPC worker's devices, free memory, link and compute speed."""
    endpoints: tuple[str, ...]

    @classmethod
    def from_wire(cls, data: dict) -> RpcProbe:
        return cls(tuple(data["endpoints"]))


@dataclass(frozen=True)
class Calibrate:
    """The card's memory and host-to-device bandwidth, timed with torch (never beside
    llama.cpp in one process: a process holding both CUDA runtimes aborted in free())."""
    device: int = 0

    @classmethod
    def from_wire(cls, data: dict) -> Calibrate:
        return cls(int(data.get("device", 0)))


EXPERT_TYPES = tuple(TYPES)  # the ggml types MoE GGUFs keep their experts in


@dataclass(frozen=True)
class TimeKernels:
    """ggml's CPU expert kernels timed for `types` at each of `threads` (engine/kernel_rates.py),
    over `buffer_bytes` of experts (well past any last-level cache)."""
    threads: tuple[int, ...]
    types: tuple[str, ...] = EXPERT_TYPES
    buffer_bytes: int = BUFFER_BYTES

    @classmethod
    def from_wire(cls, data: dict) -> TimeKernels:
        return cls(tuple(int(n) for n in data["threads"]), tuple(str(t) for t in data["types"]),
                   int(data["buffer_bytes"]))


ProbeRequest = DryRun | Measure | Evaluate | RpcProbe | Calibrate | TimeKernels


@dataclass(frozen=True)
class Chunks:
    """Evaluate's progress: `done` of `total` chunks of the text scored so far."""
    kind: ClassVar[str] = "chunks"
    done: int
    total: int
