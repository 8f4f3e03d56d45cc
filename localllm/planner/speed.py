"""The speed model: predicted decode and prefill tokens per second of a placement on a card.

Decode at batch 1 is bound by memory: each token reads every weight it uses once (for MoE only
the experts it routes to), from the memory of the device that holds it, and reads the KV cache
of the context so far. Prefill is bound by compute on the GPU, and by PCIe when weights of
CPU-resident blocks are copied to the GPU for each prompt batch (llama.cpp's op offload).

Constants were fitted to decode measured on an H200 (synthetic Q4_0 models, see the device
notes): 1.1B 1055 tok/s, 8B 345, 27B-class 118 with everything on the GPU are a fixed cost per
block plus bytes over 48% of peak bandwidth; f16 KV at 32K depth cost 8B 1.8 ms per token (50%
of peak), q8_0 KV at 32K the 27B 10.7 ms (9%); 16 cores reading weights reached 57 GB/s.
Per-card bandwidth efficiency and host bandwidth are in the card profiles; `--measure`
replaces them with measured figures.

Decode slows as the context fills: every token reads the KV cache of the context so far, and a
block's attention runs where its KV lives. On the GPU that is a bandwidth cost; on the CPU it is
compute (flash attention over n_head x head_dim per cell), far slower than the weights' bytes
suggest: on the H200's 16-core host, 19 dense-27b blocks in RAM cost 180 ms more per token after
a 16K prompt than after a short one (35 GFLOP/s of attention, q4_0 KV); f16 KV reached 46.
"""

from __future__ import annotations

from dataclasses import dataclass

from localllm.modelstore.shape import SLIDING

from .card import Card
from .costs import ModelCosts, per_costs
from .host_reads import EXPERT_ROUND_TRIP_SECONDS, decode_threads, expert_read_bps
from .memory import CPU, ContextSettings, block_devices, kv_row_bytes
from .placements import Placement, head_in_ram, in_ram

# Decode is predicted at this depth: a conversation's first screens, where a user meets it.
DECODE_DEPTH = 1024
GPU_BLOCK_SECONDS = 33e-6  # kernel launches per block and token on the GPU
# A recurrent (Gated DeltaNet) block on the GPU runs about twice the kernels of an attention
# block at batch 1 (its convolution, gates, norms and the delta-rule scan), each bound by launch
# and latency, not bytes. Fitted to the H200 (every weight on the GPU, through the
# daemon: the hybrid 35B-A3B and 80B-A3B shapes decoded 273 and 227 tok/s where the model
# without it priced 394 and 339; with it 267 and 228); scripts/bench/bench_resident.py measures it.
GPU_RECURRENT_BLOCK_SECONDS = 40e-6
TOKEN_SECONDS = 0.5e-3  # the runner's own loop per token (sampling, Python)
CROSSING_SECONDS = 0.1e-3  # hidden state between GPU and CPU, and the sync it forces
# Flash attention at batch 1 on a GPU costs per query head, not per byte of KV: each query
# head walks the cells of its KV head, dequantizing them (quantized K/V) as it goes, so a model
# with 8 query heads per KV head pays 8 walks over the same bytes. Seconds per query-head
# element (n_head x (head_dim_k + head_dim_v), per cell) on the H200, by cache type, fitted to
# llama-bench depth costs there: f16 8B at 32K 1.8 ms (predicted 1.6), Qwen3-30B-A3B at 16K
# 1.1 ms (1.2); q8_0 dense-27b at 32K 10.7 ms (11.1), Qwen3-30B-A3B at 16K 3.3 ms (3.2). A
# bytes-per-second view (the model before) put q8_0 at 9% of peak for the first and 5% for the
# second: it priced a quantized cache too cheap on many-heads-per-KV-head models, and chose
# q8_0 for a band that decodes deep, where f16 with fewer experts on the GPU is faster. q4_0 is
# as fast as q8_0 (test-backend-ops perf on an H100, one token, 8 query heads of 128 a KV
# head: 0.84x q8_0's cost per added cell from 16K to 32K, 1.07x at 16K; it was priced 1.8x
# before it was measured). Other cards scale by
# their bandwidth or their compute against the H200's, whichever slows them less: walking
# quantized cells is bound by both, and an H100, with the H200's compute and 70% of its
# bandwidth, measured Qwen3-30B-A3B at 16K (q8_0) at 2.96 ms where scaling by bandwidth alone
# priced 4.6 (llama-bench, 16 threads, every weight on the GPU).
GPU_ATTENTION_ELEMENT_SECONDS = {"f16": 1.9e-13, "bf16": 1.9e-13, "f32": 3.8e-13,
                                 "q8_0": 5.0e-13, "q4_0": 5.0e-13}
# Patch 0007: with a quantized cache, one block takes the query heads of one KV head (8, 4 or 2,
# the most that divide the heads a KV head serves), so the walk over the cells (their loads and
# dequantization) is shared by them and the rest (dot products, softmax) stays per query head.
# The share of the figures above that the walk is, by cache type (test-backend-ops perf, one
# token, 8 query heads a KV head; lab/device/fattn_check.sh): a type absent is priced as before.
# Measured on an H100 (2026-12-07): with heads of 128 the share grows with the cells (q8_0
# 0.09 at 16K, 0.29 at 32K; q4_0 0.16, 0.37), below the SMs' worth of blocks the kernel is
# slower, and heads of 256 ran slower grouped at every length; the median over all cases at
# 16K and more was about 0 (q8_0) and 0.12 (q4_0). The runner uses it for heads up to 128
# (engine/model.py choose_grouped_attention) and none is priced grouped yet: a constant share
# fits none of these; decode deep in a q8_0 cache is priced a few percent slow for them.
GPU_GROUPED_WALK_SHARE: dict[str, float] = {}
GPU_ATTENTION_REFERENCE_GBS = 4800.0  # the H200's, where the figures above were measured
GPU_ATTENTION_REFERENCE_TFLOPS = 989.0
GPU_KV_READ_EFFICIENCY = 0.6  # a cache with as many KV heads as query heads is bound by bytes
CPU_QUANTIZED_KV_PENALTY = 2.0  # the CPU dequantizes K/V rows as it attends
PREFILL_GPU_EFFICIENCY = 0.18  # of the card's FP16 tensor TFLOPS, quantized matmuls included
CPU_GFLOPS_PER_CORE = 40.0  # prompt matmuls on CPU cores (AVX2/AVX-512, quantized weights)
UBATCH_BLOCK_SECONDS = 60e-6  # per block and ubatch: launches and syncs, why bigger ubatches win
# The lm-head in RAM reads slower than its bytes: a tied one (the token table) cannot use the
# CPU's repacked layout, and a 150-260k row matmul splits poorly over threads. On the H200 an
# lm-head in RAM lost 10% of decode to llama.cpp's plan of the same bytes in blocks.
CPU_OUTPUT_PENALTY = 2.0
# A recurrent (Gated DeltaNet) block on the CPU costs more than its weights: the state update
# runs there too. Fitted to qwen35-27b at 4096 on a 12 GiB budget (predicted 14.0, measured 11.7).
CPU_RECURRENT_BLOCK_SECONDS = 1.0e-3
# A whole MoE block on the CPU (router, top-k, eight small expert matmuls, each a thread
# barrier) costs more than its bytes: qwen3-30b-a3b with 16 of 48 blocks in RAM measured 61 tok/s
# where bytes alone predicted 76. Experts alone in RAM (router on the GPU) measured faster.
CPU_MOE_BLOCK_SECONDS = 0.2e-3
# CPU flash attention at decode, FLOP/s per thread, by K type (fitted as said above).
CPU_ATTENTION_FLOPS_PER_THREAD = {"f16": 2.9e9, "bf16": 2.9e9, "f32": 2.9e9}
CPU_ATTENTION_FLOPS_QUANTIZED = 2.25e9
# An FFN in RAM under attention on the GPU sends the hidden state to the host and back: one
# crossing's cost per block, fitted to the H200 (dense-27b, 12 GiB, 32K, q4_0 KV, FFN of 29
# blocks in RAM: measured 9.2 tok/s after a short prompt and 8.8 after 16K; predicted 9.1, 8.7).


# The expert cache (issue #40, expert_pool.py): a block it serves runs a second
# up/gate/act/down chain on the pool (a lookup, four kernels and an add) beside the CPU's.
# Fitted to the H200 (the 80B class at 62-70% hits, 3-9% under measured at 25 us);
# it was 25 us while each block's routed experts came back in a copy of their own, which
# patches/0004 made one copy a step.
POOL_BLOCK_SECONDS = 13e-6
# With its misses on the GPU (patches/0003, ExpertPool.misses_on_gpu) the GPU reads the missed
# experts where they lie in pinned RAM, over PCIe, at this share of the card's pcie_gbs (a
# kernel's reads of whole experts, each a few hundred KB); the CPU's chain and its two
# crossings go. 0.7 before, fitted while a recurrent block on the GPU cost no more than
# an attention block: the pool's 80B class was right for the wrong reason, and Qwen3-30B-A3B
# (no recurrent blocks) 15-18% under at 6 GiB. Refitted with GPU_RECURRENT_BLOCK_SECONDS on
# 21 H200 runs (the 80B class, the 35B hybrid and Qwen3-30B-A3B with their pools at the hit
# rates they measured, and both hybrids with every weight on the GPU): all within -5%..+8%.
MAPPED_READ_FRACTION = 0.9


@dataclass(frozen=True)
class ExpertPool:
    """An expert cache as decode sees it: `slots` experts in VRAM shared by the blocks of
    `blocks` whose experts a placement keeps in RAM. Of their routed experts, the share
    `hit_rate(served)` is found in the pool and read by the GPU; the rest by the CPU, or, with
    `misses_on_gpu`, by the GPU from pinned RAM over PCIe. After each step the engine copies
    `swap_bytes` into the pool over PCIe (not overlapped yet)."""

    slots: int
    n_expert: int
    blocks: frozenset[int]
    curve: tuple[tuple[float, float], ...]  # (slots per served block / n_expert, hit rate)
    swap_bytes: float = 0.0
    misses_on_gpu: bool = False

    def hit_rate(self, served: int) -> float:
        """The expected hit rate with the slots spread over `served` blocks (the curve
        interpolated, linear between its points; 1 past the last)."""
        if served <= 0 or self.slots <= 0:
            return 0.0
        return curve_at(self.curve, self.slots / (served * self.n_expert))


def curve_at(curve: tuple[tuple[float, float], ...], share: float) -> float:
    """A hit-rate curve's value at `share` of a block's experts held: linear between its
    points, from 0 at none to 1 at all."""
    points = ((0.0, 0.0), *curve, (1.0, 1.0))
    for (f0, h0), (f1, h1) in zip(points, points[1:], strict=False):
        if share <= f1:
            return h0 + (h1 - h0) * (share - f0) / max(f1 - f0, 1e-9)
    return 1.0


@dataclass(frozen=True)
class Speed:
    decode_tps: float
    prefill_tps: float
    decode_seconds_gpu: float  # per token, weights and KV read on the GPUs
    decode_seconds_cpu: float  # per token, weights and KV read from host RAM
    decode_flops_cpu: float = 0.0  # per token, matmul FLOPs of the weights the CPU multiplies
    # of decode_seconds_gpu, the expert pool's misses read by the GPU from pinned RAM
    decode_seconds_mapped: float = 0.0


def mapped_bandwidth(card: Card) -> float:
    """Bytes/s a GPU kernel reads pinned host memory at, in place (the expert cache's misses
    on the GPU)."""
    return max(1.0, card.pcie_gbs * 1e9 * MAPPED_READ_FRACTION)


def gpu_bandwidths(card: Card) -> dict[str, float]:
    """Bytes/s batch-1 decode reads weights at on each GPU (a mixed box: each its own)."""
    return {g.device: g.bandwidth_gbs * 1e9 * card.decode_efficiency for g in card.gpu_list}


def attention_seconds(costs: ModelCosts, i: int, settings: ContextSettings, depth: int,
                       on_gpu: bool, card: Card, threads: int,
                       gpu_peak_gbs: float | None = None,
                       gpu_tflops: float | None = None, grouped: bool = True) -> float:
    """Attention of block i over `depth` cells, on the device that holds its KV (a GPU of
    `gpu_peak_gbs` and `gpu_tflops`, the card's by default). `grouped`: the engine's decode
    kernel shares the walk over a quantized cache among a KV head's query heads (patch 0007);
    False prices the kernel before it (runs recorded then)."""
    if not costs.kv_k_elements[i]:
        return 0.0
    cells = min(depth, costs.sliding_window) if costs.kinds[i] == SLIDING else depth
    row = (kv_row_bytes(settings.type_k, costs.kv_k_elements[i])
           + kv_row_bytes(settings.type_v, costs.kv_v_elements[i]))
    if on_gpu:
        peak = gpu_peak_gbs or card.bandwidth_gbs
        heads = heads_per_block(costs, i) \
            if grouped and settings.type_k in GPU_GROUPED_WALK_SHARE else 1
        per_element = (_gpu_element_seconds(settings.type_k, heads)
                       + _gpu_element_seconds(settings.type_v, heads)) / 2
        slower = min(GPU_ATTENTION_REFERENCE_GBS / max(1.0, peak),
                     GPU_ATTENTION_REFERENCE_TFLOPS / max(1.0, gpu_tflops or card.fp16_tflops))
        walks = cells * costs.attention_flops[i] / 2 * per_element * slower
        return max(walks, cells * row / (peak * 1e9 * GPU_KV_READ_EFFICIENCY))
    quantized = settings.type_k not in CPU_ATTENTION_FLOPS_PER_THREAD
    penalty = CPU_QUANTIZED_KV_PENALTY if quantized else 1.0
    read = cells * row * penalty / (card.host_bandwidth_gbs * 1e9)
    rate = (CPU_ATTENTION_FLOPS_QUANTIZED if quantized
            else CPU_ATTENTION_FLOPS_PER_THREAD[settings.type_k]) * threads
    return max(read, cells * costs.attention_flops[i] / rate)


@per_costs
def attention_row(costs: ModelCosts, type_k: str, type_v: str, depth: int, on_gpu: bool,
                  card: Card, threads: int, gpu_peak_gbs: float | None = None,
                  gpu_tflops: float | None = None, grouped: bool = True) -> tuple[float, ...]:
    """attention_seconds of every block with these KV types (all it reads of the settings)."""
    settings = ContextSettings(depth, type_k, type_v)
    return tuple(attention_seconds(costs, i, settings, depth, on_gpu, card, threads, gpu_peak_gbs,
                                   gpu_tflops, grouped)
                 for i in range(costs.n_blocks))


def heads_per_block(costs: ModelCosts, i: int) -> int:
    """Query heads one block of patch 0007's decode kernel takes for block i's attention."""
    per_kv_head = costs.attention_flops[i] // 2 // max(
        1, costs.kv_k_elements[i] + costs.kv_v_elements[i])
    return next((n for n in (8, 4, 2) if per_kv_head and per_kv_head % n == 0), 1)


def _gpu_element_seconds(cache_type: str, heads: int = 1) -> float:
    """Seconds per query-head element, its walk shared by `heads` query heads."""
    alone = GPU_ATTENTION_ELEMENT_SECONDS.get(cache_type, GPU_ATTENTION_ELEMENT_SECONDS["q4_0"])
    walk = GPU_GROUPED_WALK_SHARE.get(cache_type, 0.0)
    return alone * (1 - walk + walk / heads)


def pool_hits(costs: ModelCosts, devices: list[str], kept, pool: ExpertPool | None
               ) -> tuple[set[int], float]:
    """The blocks an expert pool serves on this placement (those of its blocks whose experts
    are in RAM) and the hit rate its slots give them."""
    if pool is None:
        return set(), 0.0
    served = {i for i in pool.blocks
              if costs.expert_bytes[i] and (devices[i] == CPU or kept.experts[i])}
    return served, pool.hit_rate(len(served))


@per_costs
def predict_speed(costs: ModelCosts, placement: Placement, settings: ContextSettings, card: Card,
                  n_threads: int | None = None, depth: int = DECODE_DEPTH,
                  pool: ExpertPool | None = None, grouped_attention: bool = True) -> Speed:
    devices = block_devices(costs, placement, card.n_gpus if card.has_gpu else 0)
    kept = in_ram(costs, placement)
    served, hits = pool_hits(costs, devices, kept, pool)
    threads = decode_threads(card, n_threads)
    host_bw = card.host_bandwidth_gbs * 1e9 * threads / max(1, card.cores)
    expert_bw = expert_read_bps(card, threads, costs.expert_types)
    bandwidths = gpu_bandwidths(card)
    depth = min(depth, settings.n_ctx)
    gpu_s = cpu_s = mapped_s = 0.0
    cpu_flops = 0.0
    crossings = 0
    previous = CPU  # token embeddings are looked up on the CPU
    mapped = bool(served) and pool.misses_on_gpu
    kv = (settings.type_k, settings.type_v)
    cpu_attention = attention_row(costs, *kv, depth, False, card, threads)
    gpu_attention = {g.device: attention_row(costs, *kv, depth, True, card, threads,
                                             g.bandwidth_gbs, g.fp16_tflops, grouped_attention)
                     for g in card.gpu_list}
    if served:  # the pool's GPU: its hits, its second chains, the copies after each step
        routed = sum(costs.expert_bytes[i] for i in served) * costs.expert_active_fraction
        gpu_s += routed * hits / bandwidths[card.gpu_list[0].device] \
            + POOL_BLOCK_SECONDS * len(served) + pool.swap_bytes / (card.pcie_gbs * 1e9)
        if mapped:  # the misses too, read from pinned RAM, in a chain of their own
            mapped_s = (routed * (1.0 - hits) / mapped_bandwidth(card)
                        + POOL_BLOCK_SECONDS * len(served)) * card.served_mapped_factor
            gpu_s += mapped_s
    for i in range(costs.n_blocks):
        if not costs.block_bytes[i] and not costs.expert_bytes[i]:
            continue  # a skipped NextN block
        d = devices[i]
        experts_on_cpu = kept.experts[i]
        expert_read = costs.expert_bytes[i] * costs.expert_active_fraction
        if i in served:
            # what the CPU still reads (the hits, and mapped misses, are priced above)
            expert_read *= 0.0 if mapped else 1.0 - hits
        active_params = costs.block_params[i]
        if d == CPU:
            cpu_s += costs.block_bytes[i] / host_bw + expert_read / expert_bw
            if costs.state_bytes[i]:
                cpu_s += CPU_RECURRENT_BLOCK_SECONDS
            if costs.expert_bytes[i]:
                cpu_s += CPU_MOE_BLOCK_SECONDS
            if i in served:  # the pool's hits: to the GPU and back
                crossings += 2
            cpu_s += cpu_attention[i]
            cpu_flops += 2 * active_params
        else:
            gpu_bw = bandwidths[d]
            ffn_cpu = kept.dense[i]
            gpu_s += (costs.block_bytes[i] - ffn_cpu) / gpu_bw + GPU_BLOCK_SECONDS
            if costs.state_bytes[i]:
                gpu_s += GPU_RECURRENT_BLOCK_SECONDS
            gpu_s += gpu_attention[d][i]
            if ffn_cpu:
                cpu_s += ffn_cpu / host_bw
                crossings += 1
                ffn_params = active_params * ffn_cpu / max(1, costs.block_bytes[i])
                cpu_flops += 2 * ffn_params
                active_params = 0
            if experts_on_cpu and not (mapped and i in served):
                cpu_s += expert_read / expert_bw
                if card.host_read_gbs:  # the measured model: its own price of the round trip
                    cpu_s += EXPERT_ROUND_TRIP_SECONDS
                else:
                    crossings += 2
            elif not experts_on_cpu:
                gpu_s += expert_read / gpu_bw
        crossings += d != previous
        previous = d
    output_device = CPU if head_in_ram(placement) else devices[-1]
    if output_device == CPU:
        cpu_s += costs.output_bytes * (CPU_OUTPUT_PENALTY if card.has_gpu else 1.0) / host_bw
        cpu_flops += 2 * costs.output_params
    else:
        gpu_s += costs.output_bytes / bandwidths[output_device]
    crossings += output_device != previous
    cpu_s *= card.served_host_factor  # what serving measured of this host (1.0: as priced)
    decode_s = gpu_s + cpu_s + TOKEN_SECONDS + CROSSING_SECONDS * max(0, crossings - 1)
    return Speed(
        decode_tps=1.0 / decode_s,
        prefill_tps=prefill_tps(costs, placement, settings, card, threads),
        decode_seconds_gpu=gpu_s,
        decode_seconds_cpu=cpu_s,
        decode_flops_cpu=cpu_flops,
        decode_seconds_mapped=mapped_s,
    )


# ---- reading a prompt -------------------------------------------------------------------------
#
# llama.cpp reads a prompt in micro-batches (n_ubatch tokens). On a GPU, for a micro-batch of 32
# tokens or more, every weight the placement keeps in RAM is copied to the GPU and multiplied
# there (op offload), once per micro-batch; attention runs on the GPU too, and the KV rows of
# blocks whose cache lives in RAM cross with it. So a micro-batch costs a fixed crossing plus
# its tokens' FLOPs: bigger micro-batches share the crossing over more tokens, at the price of a
# compute buffer that grows with them. Fitted to llama-bench pp4096 on the H200 (dense-27b Q4_0,
# q8_0 KV, 16 threads): the FFN of blocks 25-65 in RAM (7.3 GB) read 258 / 425 / 835 / 1219 tok/s
# at ubatch 256 / 512 / 1024 / 2048, whole blocks 0-26 in RAM (5.7 GB) 485 at 512 and 1398 at
# 2048: about 0.93 s per micro-batch for the crossing and 0.3 ms per token (54 GFLOP at 18% of
# the FP16 peak). That crossing ran at 7 GB/s because the weights sat in the file's mapped
# pages (llama.cpp's default load mode): pageable memory, staged by the driver. Loaded without
# mmap they go to the GPU's pinned host buffer (make_cpu_buft_list puts it first), which the
# copy reads at PCIe speed: Qwen3-30B-A3B with the experts of 24 blocks in RAM (8.2 GB) read a
# 16K prompt at 1744 tok/s mapped and 5857 pinned at ubatch 2048, 438 and 2223 at 512 (about
# 43 GB/s), and decoded at 66 mapped, 71 pinned. Plans within RAM on a GPU pin them where the
# file maps them (build.py sets pin_in_place; engine/host_pin.py), which avoids load_mode none's
# second copy (a band switch took 7.7 s that way instead of 1.8 s); past RAM the file's pages
# must stay pageable, and reading them from the disk per micro-batch (per_ubatch_s) costs
# more than the crossing.
PINNED_OFFLOAD_FRACTION = 0.85  # of the card's pcie_gbs (H200: 50 -> 43 GB/s)
MAPPED_OFFLOAD_FRACTION = 0.14  # from the file's mapped pages (H200: 7 GB/s)


@dataclass(frozen=True)
class PromptCost:
    """What reading a prompt costs on one placement, so that any length at any depth is priced
    without walking the blocks again."""

    flops_per_token: float  # the weights' matmuls
    crossing_bytes: int  # weights in RAM that cross to the GPU per micro-batch
    fixed_seconds: float  # launches and syncs per micro-batch
    flops_rate: float  # FLOP/s of the device that multiplies (the GPU, or the CPU's cores)
    on_gpu: bool
    attention_flops_per_cell: float = 0.0  # full-attention blocks, per token and cell
    sliding_flops_per_cell: float = 0.0  # sliding-window blocks (cells capped at the window)
    sliding_window: int = 0
    crossing_kv_per_cell: float = 0.0  # KV bytes of blocks cached in RAM, per cell of context
    offload_bps: float = 1.0

    def seconds(self, n_tokens: int, n_ubatch: int, start: int = 0) -> float:
        """Reading `n_tokens` after `start` tokens of context, `n_ubatch` at a time."""
        if n_tokens <= 0:
            return 0.0
        n_ub = -(-n_tokens // max(1, n_ubatch))
        middle = start + n_tokens / 2  # the average depth a token attends over
        window = min(middle, self.sliding_window) if self.sliding_window else middle
        flops = n_tokens * (self.flops_per_token + self.attention_flops_per_cell * middle
                            + self.sliding_flops_per_cell * window)
        seconds = flops / self.flops_rate + n_ub * self.fixed_seconds
        if self.on_gpu and n_ubatch >= 32:
            crossed = n_ub * (self.crossing_bytes + self.crossing_kv_per_cell * middle)
            seconds += crossed / self.offload_bps
        return seconds


# The floor on prompt reading: whatever the workload, a plan reads a long prompt at no less than
# PROMPT_FLOOR of the speed its placement reads it at with llama.cpp's default micro-batch (what
# `llama-server --fit` runs). Where weights in RAM cross per micro-batch, a smaller one reads at
# half of that (the H200, dense-27b: 258 tok/s at 256, 425 at 512), which a chat's short prompts
# never show and the first long prompt does (issue 36); where nothing crosses, the micro-batch
# costs only its launches and any size passes.
DEFAULT_UBATCH = 512
PROMPT_FLOOR = 0.8
LONG_PROMPT = 16384  # the long prompt the floor is priced on (half the context where smaller)


def long_prompt(n_ctx: int) -> int:
    return max(1, min(LONG_PROMPT, n_ctx // 2))


def prompt_seconds(cost: PromptCost, n_tokens: int, n_ubatch: int,
                   per_ubatch_s: float = 0.0) -> float:
    """Reading `n_tokens` into an empty context, with `per_ubatch_s` more per micro-batch
    (weights read from disk cross once per micro-batch too)."""
    return cost.seconds(n_tokens, n_ubatch) + -(-n_tokens // max(1, n_ubatch)) * per_ubatch_s


def below_prompt_floor(cost: PromptCost, n_ctx: int, n_ubatch: int,
                       per_ubatch_s: float = 0.0) -> bool:
    """Whether this micro-batch reads a long prompt slower than PROMPT_FLOOR of the default
    micro-batch on the same placement (see DEFAULT_UBATCH)."""
    n = long_prompt(n_ctx)
    if n_ubatch >= DEFAULT_UBATCH or n <= n_ubatch:
        return False
    return prompt_seconds(cost, n, n_ubatch, per_ubatch_s) * PROMPT_FLOOR > \
        prompt_seconds(cost, n, DEFAULT_UBATCH, per_ubatch_s)


def prefill_tps(costs: ModelCosts, placement: Placement, settings: ContextSettings, card: Card,
                n_threads: int | None = None) -> float:
    """Tokens per second over one micro-batch at the start of the context."""
    ub = settings.n_ubatch
    seconds = prompt_cost(costs, placement, settings, card, n_threads).seconds(ub, ub)
    return ub / seconds if seconds > 0 else 0.0


def _prompt_rate(card: Card, threads: int, device: str | None = None) -> float:
    """FLOP/s of prompt matmuls on `device` (a GPU: its own rate; None: the card's)."""
    if card.has_gpu:
        tflops = card.gpu(device).fp16_tflops if device else card.fp16_tflops
        return tflops * 1e12 * PREFILL_GPU_EFFICIENCY
    return threads * CPU_GFLOPS_PER_CORE * 1e9


@per_costs
def prompt_cost(costs: ModelCosts, placement: Placement, settings: ContextSettings, card: Card,
                n_threads: int | None = None, pinned: bool = True) -> PromptCost:
    """The terms of reading a prompt with this placement (see the notes above); `pinned`: its
    weights in RAM sit in pinned memory (a plan within RAM), else in the file's mapped pages."""
    devices = block_devices(costs, placement, card.n_gpus if card.has_gpu else 0)
    threads = min(n_threads or card.cores, card.cores)
    flops = 2.0 * costs.output_params
    crossing = costs.output_bytes if head_in_ram(placement) or devices[-1] == CPU else 0
    kept = in_ram(costs, placement)
    full = sliding = kv_crossing = 0.0
    # Several GPUs run their layers one after another: the rate is the blocks' FLOPs over the
    # sum of each GPU's time (weights in RAM are multiplied on the first GPU).
    first_gpu = card.devices[0] if card.has_gpu else CPU
    by_device: dict[str, float] = {first_gpu: 2.0 * costs.output_params}
    for i in range(costs.n_blocks):
        if not costs.block_bytes[i] and not costs.expert_bytes[i]:
            continue
        flops += 2.0 * costs.block_params[i]
        where = first_gpu if devices[i] == CPU else devices[i]
        by_device[where] = by_device.get(where, 0.0) + 2.0 * costs.block_params[i]
        if devices[i] == CPU:
            crossing += costs.block_bytes[i] + costs.expert_bytes[i]
        else:
            crossing += kept.dense[i] + kept.experts[i]
        if not costs.kv_k_elements[i]:
            continue
        if costs.kinds[i] == SLIDING and costs.sliding_window:
            sliding += costs.attention_flops[i]
        else:
            full += costs.attention_flops[i]
            if devices[i] == CPU:
                kv_crossing += (kv_row_bytes(settings.type_k, costs.kv_k_elements[i])
                                + kv_row_bytes(settings.type_v, costs.kv_v_elements[i]))
    return PromptCost(
        flops_per_token=flops, crossing_bytes=int(crossing),
        fixed_seconds=costs.n_blocks * UBATCH_BLOCK_SECONDS,
        flops_rate=_combined_rate(card, threads, by_device) if card.n_gpus > 1
        else _prompt_rate(card, threads),
        on_gpu=card.has_gpu, attention_flops_per_cell=full, sliding_flops_per_cell=sliding,
        sliding_window=costs.sliding_window, crossing_kv_per_cell=kv_crossing,
        offload_bps=max(1.0, card.pcie_gbs * 1e9 * (PINNED_OFFLOAD_FRACTION if pinned
                                                    else MAPPED_OFFLOAD_FRACTION)),
    )


def _combined_rate(card: Card, threads: int, flops_by_device: dict[str, float]) -> float:
    total = sum(flops_by_device.values())
    seconds = sum(f / _prompt_rate(card, threads, d) for d, f in flops_by_device.items() if f)
    return total / seconds if seconds > 0 else _prompt_rate(card, threads)
