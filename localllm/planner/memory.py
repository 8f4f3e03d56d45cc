r"""The memory model: what a placement of a model costs on each device, as llama.cpp allocates it.

Pure functions of a ModelShape (through `ModelCosts`), a `Placement`, `ContextSettings` and a
`Card`. The rules follow llama.cpp (src/llama-model.cpp, llama-kv-cache*.cpp, vendored in
llama-cpp-python 0.3.36):
- `n_gpu_layers = N` puts the last N of the n_layer + 1 "layers" on the GPU, the output layer
  (lm-head + final norm) first; the input token table always stays on the CPU; with tied
  embeddings the lm-head is a second copy of the token table on the output layer's device.
- NextN/MTP blocks are skipped at load unless MTP is used, and hold no KV in the main context.
- KV follows its layer's attention: full-attention layers hold n_ctx cells (padded to 256) per
  sequence, sliding-window layers pad(min(n_ctx, window + n_ubatch), 256) per sequence with
  swa_full=False (the runner's cache is not unified: one stream of cells per slot), recurrent
  layers a fixed f32 state per sequence, and one more per snapshot kept for taking back
  rejected drafts (n_rs_seq). A K or V row of n elements takes n / block *
  block_bytes. The runner's checkpoints of the recurrent or sliding-window state
  (`checkpoint_bytes`) are the CPU's overhead: they live in RAM.
- A block's attention (with its KV) and its FFN may sit on different devices: the FFN matrices
  of the last `n_cpu_ffn_layers` blocks stay in RAM through a tensor override, as llama.cpp's
  `-ot "blk\.(...)\.ffn_(up|gate|down)\.=CPU"`.
- Several GPUs (split mode layer): the GPU layers are cut into contiguous runs, one per GPU in
  order, by `tensor_split`; a placement's `gpu_split` holds the count per GPU (llama.cpp cuts
  at count / total, so the counts are exact), and `split_layers` finds counts that keep every
  GPU under its own budget. The output layer sits on the last GPU that holds layers; weights
  kept in RAM are multiplied for prompt batches on the first GPU (ggml's scheduler offloads
  them to the highest-priority backend), so only that one needs room to copy a block in.
- Compute buffers come from a dry-run load where one was measured (`ComputeTable`), else from a
  formula that is deliberately on the high side.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from localllm.kv_types import KV_TYPES
from localllm.modelstore.shape import SLIDING, ModelShape
from localllm.speculative import logit_rows

from .card import MIB, Card
from .costs import ModelCosts, model_costs, per_costs
from .placements import CPU, Placement, head_in_ram, in_ram, overridden
from .plan import DeviceMemory



def kv_element_bytes(kv_type: str) -> float:
    """Bytes one element of the KV cache takes in `kv_type` (a block's bytes over its size)."""
    block, size = KV_TYPES[kv_type]
    return size / block


def kv_row_bytes(kv_type: str, n_elements: int) -> int:
    block, size = KV_TYPES[kv_type]
    return n_elements // block * size


def pad(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class ContextSettings:
    n_ctx: int
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    n_ubatch: int = 512
    swa_full: bool = False
    n_seq: int = 1
    n_rs_seq: int = 0  # recurrent-state snapshots per sequence (drafts taken back), llama.cpp's


# ---- placement -> devices ---------------------------------------------------------------------

@per_costs
def block_devices(costs: ModelCosts, placement: Placement, n_gpus: int) -> tuple[str, ...]:
    """The device of each block, then of the output layer (last entry), as llama.cpp assigns
    them: the last n_gpu_layers of n_blocks + 1, cut into runs per GPU in order by the
    placement's gpu_split (evenly over the GPUs without one)."""
    n = costs.n_blocks
    n_gpu = max(0, min(placement.n_gpu_layers, n + 1)) if n_gpus else 0
    start = n + 1 - n_gpu
    split = placement.gpu_split if len(placement.gpu_split) == n_gpus else ()
    ends, total = [], 0
    for k in split:
        total += k
        ends.append(total)
    devices = []
    for i in range(n + 1):
        if i < start:
            devices.append(CPU)
        elif split:
            gpu = next((g for g, end in enumerate(ends) if i - start < end), n_gpus - 1)
            devices.append(f"CUDA{gpu}")
        else:
            gpu = min(n_gpus - 1, (i - start) * n_gpus // max(1, n_gpu))
            devices.append(f"CUDA{gpu}")
    return tuple(devices)


def gpu_layers(shape: ModelShape, card: Card,
               placement: Placement) -> tuple[tuple[str, int], ...]:
    """llama.cpp's layers per device, the CPU's first, then each GPU's (the output layer
    counted as the last layer): the plan's device_layers, and its tensor_split after the CPU."""
    costs = model_costs(shape)
    devices = block_devices(costs, placement, card.n_gpus)
    return tuple((d, devices.count(d)) for d in (CPU, *card.devices))


def layer_gpu_bytes(costs: ModelCosts, placement: Placement,
                    settings: ContextSettings) -> list[int]:
    """What each of llama.cpp's n_blocks + 1 layers takes on the GPU that holds it: its weights
    less what the placement keeps in RAM (FFN, experts, the lm-head), and its KV."""
    kept = in_ram(costs, placement)
    kv_bytes = kv_by_block(costs, settings)
    out = []
    for i in range(costs.n_blocks):
        out.append(costs.block_bytes[i] - kept.dense[i] + costs.expert_bytes[i]
                   - kept.experts[i] + kv_bytes[i])
    out.append((0 if head_in_ram(placement) else costs.output_bytes) + costs.output_norm_bytes)
    return out


def split_layers(layer_bytes: list[int], rooms: list[int],
                 shares: list[float]) -> tuple[int, ...] | None:
    """Counts of consecutive layers per device, in order, so that each device's layers fit its
    room and the counts follow `shares` as closely as that allows (a device of share 0 takes
    none); None when the layers do not fit at all.

    Device by device: the share of what is left, but at least what the devices after it cannot
    hold (they take the tail greedily, each as much as fits) and at most what fits here."""
    n, k = len(layer_bytes), len(rooms)
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def fits_from(start: int, room: int) -> int:
        """The most layers from `start` on whose bytes fit `room`."""
        lo, hi = 0, n - start
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prefix[start + mid] - prefix[start] <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def tail_cover(first_device: int, start: int) -> int:
        """How many of the layers [start, n) devices first_device.. can hold, taking the
        tail back to front."""
        end = n
        for d in range(k - 1, first_device - 1, -1):
            if not shares[d] or end <= start:
                continue
            lo, hi = start, end  # the smallest begin whose run [begin, end) fits the room
            while lo < hi:
                mid = (lo + hi) // 2
                if prefix[end] - prefix[mid] <= rooms[d]:
                    hi = mid
                else:
                    lo = mid + 1
            end = lo
        return n - end

    counts, start = [], 0
    for d in range(k):
        left = n - start
        if not shares[d]:
            counts.append(0)
            continue
        later = sum(shares[d + 1:])
        target = round(left * shares[d] / (shares[d] + later)) if later else left
        most = fits_from(start, rooms[d])
        # the devices after this one hold the tail: what they cannot is this one's minimum
        least = max(0, left - tail_cover(d + 1, start)) if d + 1 < k else left
        if least > most:
            return None
        counts.append(min(max(target, least), most))
        start += counts[-1]
    return tuple(counts) if start == n else None


def kv_cells(kind: str, settings: ContextSettings, window: int) -> int:
    """Cells of one sequence's stream (the cache is not unified: each slot has its own)."""
    full = pad(settings.n_ctx)
    if kind == SLIDING and not settings.swa_full and window:
        return min(full, pad(window + settings.n_ubatch))
    return full


def block_kv_bytes(costs: ModelCosts, i: int, settings: ContextSettings) -> int:
    """KV (or recurrent state) bytes of block i."""
    if costs.state_bytes[i]:
        # llama.cpp allocates (1 + n_rs_seq) rows of state per sequence (llama-memory-recurrent)
        return costs.state_bytes[i] * settings.n_seq * (1 + settings.n_rs_seq)
    if not costs.kv_k_elements[i]:
        return 0
    cells = kv_cells(costs.kinds[i], settings, costs.sliding_window) * settings.n_seq
    return cells * (kv_row_bytes(settings.type_k, costs.kv_k_elements[i])
                    + kv_row_bytes(settings.type_v, costs.kv_v_elements[i]))


@per_costs
def kv_by_block(costs: ModelCosts, settings: ContextSettings) -> tuple[int, ...]:
    """block_kv_bytes of every block."""
    return tuple(block_kv_bytes(costs, i, settings) for i in range(costs.n_blocks))


# Copies of a sequence's recurrent or sliding-window state the runner keeps in RAM, per slot
# (engine/runner/checkpoints.py: they let a prompt that diverges behind that state's reach
# restart from the copy instead of reading everything again): the latest prompt's three ends
# (checkpoints.ends) and two spaced ones, for a change earlier in a long prompt.
CHECKPOINTS_PER_SLOT = 5


@per_costs
def checkpoint_bytes(costs: ModelCosts, settings: ContextSettings) -> int:
    """The RAM of the runner's checkpoints: per slot CHECKPOINTS_PER_SLOT copies of what
    llama.cpp saves with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, the recurrent state of a hybrid
    model and the sliding-window cells of an iSWA one (the window's positions: the others are
    masked and not written); 0 for a model of full attention only."""
    one = sum(costs.state_bytes)
    if costs.has_sliding and not settings.swa_full:
        cells = min(costs.sliding_window, pad(settings.n_ctx))
        one += sum(cells * (kv_row_bytes(settings.type_k, costs.kv_k_elements[i])
                            + kv_row_bytes(settings.type_v, costs.kv_v_elements[i]))
                   for i, kind in enumerate(costs.kinds) if kind == SLIDING)
    return one * CHECKPOINTS_PER_SLOT * settings.n_seq


@dataclass(frozen=True, eq=False)
class ComputeTable:
    """Compute buffers measured by dry-run loads: (settings, placement) -> bytes per device.

    A measured point is used exactly; elsewhere the formula is used, raised by the most it fell
    short of any measurement on that kind of device (the corrections). A table is one search's
    measurements, told apart by identity: the planner's caches (per_costs) key on it."""

    measured: Mapping[tuple, Mapping[str, int]] = field(default_factory=dict)
    gpu_correction: int = 0
    host_correction: int = 0

    @staticmethod
    def key(settings: ContextSettings, placement: Placement) -> tuple:
        return (settings.n_ctx, settings.n_ubatch, settings.flash_attn, settings.type_k,
                settings.type_v, settings.swa_full, settings.n_seq,
                *(getattr(placement, f.name) for f in fields(placement)))


PIPELINE_COPIES = 4  # ggml's GGML_SCHED_MAX_COPIES: inputs kept per split when pipelining


def compute_formula(costs: ModelCosts, settings: ContextSettings, device: str,
                    holds_output: bool, holds_attention: bool, cpu_blocks: int,
                    has_gpu: bool, offloads: bool = True, pipelined: bool = False) -> int:
    """A high-side estimate of llama.cpp's compute buffer on one device.

    The worst point of the reserve graph: the larger of the logits (n_vocab f32 for each row
    that may ask for them, speculative.logit_rows, on the output's device; a full ubatch's
    before the runner capped them) and the FFN activations, plus the attention
    input that lives through the whole graph (flash attention: an f16 mask of n_ctx x n_ubatch;
    without it the n_head x n_ctx x n_ubatch f32 scores). On a GPU with CPU-resident blocks,
    llama.cpp copies a block's weights in to run prompt batches there (op offload): room for one
    block; `offloads` says whether this GPU is the one that does it (the first). Across several
    GPUs with every layer on them and no override, llama.cpp pipelines micro-batches and keeps
    PIPELINE_COPIES of each split's inputs (the hidden state and the mask) on each GPU.
    Dry runs on a CPU build, measured vs this formula: llama-8b 266 vs 283 MiB at 4096
    (413 at 131072), qwen35-27b 633 vs 660 at 131072, gemma3-27b 533 vs 558 at 4096.
    """
    ub = settings.n_ubatch
    ctx = pad(settings.n_ctx)
    logits = costs.n_vocab * min(ub, logit_rows(settings.n_seq)) * 4 if holds_output else 0
    ffn = ub * (costs.n_embd * 4 * 4 + max(costs.n_ff, costs.n_ff_active_experts) * 4 * 2)
    if not holds_attention:
        attention = 0
    elif settings.flash_attn:
        attention = ctx * ub * 2
    else:
        attention = costs.n_head * ctx * ub * 4 + ctx * ub * 4
    total = max(logits, ffn) + attention
    if device != CPU and cpu_blocks and ub >= 32 and offloads:
        total += costs.max_block_bytes
    if device != CPU and pipelined:
        total += PIPELINE_COPIES * ub * (costs.n_embd * 4 + ctx * 2)
    if device == CPU and has_gpu and not holds_output and not cpu_blocks:
        total = ub * costs.n_embd * 4 * 2  # only the input embeddings pass through the host
    return int(total * 1.05) + 16 * MIB


# ggml-cuda's stream-k matrix kernels write partial tiles to a fixup buffer: SMs x 128 x 128
# f32, 8.25 MiB on a 132-SM H100/H200, the most SMs of any card the profiles hold.
STREAM_K_FIXUP = 9 * MIB
Q8_1_BYTES_PER_VALUE = 36 / 32  # a block_q8_1: 32 int8 values, a half scale and a half sum


def cuda_pool_bytes(costs: ModelCosts, settings: ContextSettings) -> int:
    """The high-water mark of ggml-cuda's memory pool on a GPU that runs prompt batches.

    Its kernels take temporaries from a pool while an op runs (`ggml_cuda_pool_alloc`), outside
    the compute buffer llama.cpp reserves and dry runs measure; the pool keeps the largest it
    ever held until the process ends. The largest is the quantized matrix kernels' q8_1 copy of
    their input (mmq.cu, `src1_q8_1`): a micro-batch's rows, for an MoE block gathered once per
    routed expert (n_ubatch x n_expert_used rows, as wide as the wider of the hidden state and
    an expert's FFN), with stream-k's fixup tiles beside it. On the H200 a Qwen3-30B-A3B plan
    at n_ubatch 2048 went 98 MiB past a budget its compute buffers, KV and weights met."""
    rows = settings.n_ubatch * max(1, costs.n_expert_used)
    width = max(costs.n_embd, costs.n_ff_active_experts // costs.n_expert_used
                if costs.n_expert_used else costs.n_ff)
    return int(rows * width * Q8_1_BYTES_PER_VALUE) + STREAM_K_FIXUP


# Registering host memory with CUDA takes device memory for its page tables: 8 bytes per 4 KiB
# page, 2 MiB per GiB, on each GPU, mapped or not, given back at unregister
# (lab/device/host_register_probe.py on the H200: 2, 8, 32 and 80 MiB for 1, 4, 16 and 40
# GiB). A plan with weights in RAM on a GPU registers the file's mapped pages that hold them
# (engine/host_pin.py); an 80B-class plan at 12 GiB keeps 42 GiB there: 84 MiB of VRAM.
PAGE_TABLE_BYTES_PER_BYTE = 8 / 4096


def page_table_bytes(ram_weights: int, token_table: int) -> int:
    """A GPU's page tables for the weights a plan keeps in RAM, which are registered with CUDA
    when more than the token table sits there (build.loads_pinned; past RAM they stay pageable,
    and this counts them anyway: 0.2% of them, on the safe side)."""
    return int(ram_weights * PAGE_TABLE_BYTES_PER_BYTE) if ram_weights > token_table else 0


@per_costs
def block_runs(costs: ModelCosts, placement: Placement,
               n_gpus: int) -> tuple[tuple[str, int, int], ...]:
    """The blocks (not the output layer) in runs on one device, as block_devices places them:
    (device, first block, end), the CPU's run first, then each GPU's."""
    devices = block_devices(costs, placement, n_gpus)[:-1]
    out, start = [], 0
    for i in range(1, len(devices) + 1):
        if i == len(devices) or devices[i] != devices[start]:
            out.append((devices[start], start, i))
            start = i
    return tuple(out)


@per_costs
def memory_by_device(costs: ModelCosts, placement: Placement, settings: ContextSettings,
                     card: Card, compute: ComputeTable | None = None,
                     op_offload: bool = True) -> tuple[DeviceMemory, ...]:
    """Weights, KV, compute buffer and overhead per device: the GPUs in order, then the CPU.
    `op_offload=False`: the compute formula without room for llama.cpp's copy of a RAM block's
    weights (a graph that computes them in place, as the expert pool's does)."""
    n_gpus = card.n_gpus if card.has_gpu else 0
    devices = block_devices(costs, placement, n_gpus)
    runs = block_runs(costs, placement, n_gpus)
    names = [*card.devices, CPU] if card.has_gpu else [CPU]
    weights = dict.fromkeys(names, 0)
    kv = dict.fromkeys(names, 0)
    holds_attention = dict.fromkeys(names, False)
    ffn_cpu_blocks = 0
    kept = in_ram(costs, placement)
    kv_bytes = kv_by_block(costs, settings)
    # Blocks come in runs on one device (the CPU's first, then each GPU's): summed by run.
    for d, a, b in runs:
        weights[d] += sum(costs.block_bytes[a:b]) + sum(costs.expert_bytes[a:b])
        if d != CPU:
            dense, experts = sum(kept.dense[a:b]), sum(kept.experts[a:b])
            ffn_cpu_blocks += sum(1 for x in kept.dense[a:b] if x)
            weights[d] -= dense + experts
            weights[CPU] += dense + experts
        kv[d] += sum(kv_bytes[a:b])
        holds_attention[d] |= any(costs.kv_k_elements[a:b])
    output_device = CPU if head_in_ram(placement) else devices[-1]
    weights[output_device] += costs.output_bytes
    weights[devices[-1]] += costs.output_norm_bytes
    weights[CPU] += costs.embedding_bytes + costs.cpu_other_bytes
    cpu_blocks = sum(b - a for d, a, b in runs if d == CPU) + ffn_cpu_blocks
    used_gpus = {d for d, _, _ in runs if d != CPU} | ({devices[-1]} - {CPU})
    pipelined = len(used_gpus) > 1 and CPU not in devices and not overridden(placement)
    measured = compute.measured.get(ComputeTable.key(settings, placement)) if compute else None
    gpu_overhead = card.overhead_bytes + cuda_pool_bytes(costs, settings) + page_table_bytes(
        weights[CPU], costs.embedding_bytes + costs.cpu_other_bytes)
    out = []
    for name in names:
        if measured is not None and name in measured:
            buffer = int(measured[name])
        else:
            buffer = compute_formula(costs, settings, name, name == output_device,
                                     holds_attention[name], cpu_blocks, card.has_gpu,
                                     offloads=op_offload and name == names[0],
                                     pipelined=pipelined)
            if compute is not None:
                buffer += compute.gpu_correction if name != CPU else compute.host_correction
        out.append(DeviceMemory(
            device=name, weights=weights[name], kv=kv[name], compute=buffer,
            # RAM beyond weights, KV and buffers: the runner's checkpoints (not KV: no layer
            # attends to them, and the KV's device is what the speed model reads)
            # a GPU: its CUDA context, the pool its kernels' temporaries come from and the page
            # tables of the RAM it reads weights from
            overhead=gpu_overhead if name != CPU else checkpoint_bytes(costs, settings),
        ))
    return tuple(out)
