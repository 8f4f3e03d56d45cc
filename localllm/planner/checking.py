"""What a checking pass costs, built on speed.py's decode prediction.

Speculative decoding checks k drafted tokens and the next one in one pass of the model. What
that pass costs decides whether drafting pays, and it differs by device (llama-bench ppB on the
H200, dense-27b Q4_0, 16 threads; see the device notes):
- On the GPU a pass reads every weight once whatever the batch: it stays bandwidth-bound and
  grows slowly (all 66 blocks on the GPU: a pass of 2 cost 1.03x a pass of 1, 4: 1.26x,
  8: 1.75x, 16: 2.1x), about 8% of one token's weight read per extra token (the quantized
  batch kernels dequantize per column group).
- On the CPU the matmuls turn compute-bound: 24 of 66 blocks on the CPU, a pass of 2 cost
  1.42x, 4: 2.5x, 8: 4.9x, 16: 8.7x, i.e. each extra token adds about half a token's read time:
  its FLOPs at half the prompt rate (small batches multiply at a fraction of what a
  512-token ubatch reaches).
"""

from __future__ import annotations

from dataclasses import dataclass

from .card import Card
from .costs import ModelCosts, per_costs
from .memory import CPU, ContextSettings, block_devices
from .placements import Placement, in_ram
from .host_reads import decode_threads, expert_read_bps
from .speed import (
    CPU_GFLOPS_PER_CORE,
    DECODE_DEPTH,
    ExpertPool,
    attention_row,
    mapped_bandwidth,
    pool_hits,
    predict_speed,
)

GPU_CHECK_TOKEN_FRACTION = 0.08
CPU_CHECK_EFFICIENCY = 0.5  # of CPU_GFLOPS_PER_CORE, for batches of 2-16 tokens


@dataclass(frozen=True)
class CheckingCost:
    """The parts of a checking pass, so that passes of any length are priced without walking
    the blocks again: `seconds(n)` is a pass of n tokens, `seconds(1)` plain decode."""

    fixed_seconds: float  # the runner's loop and the GPU/CPU crossings, once per pass
    gpu_seconds: float  # one token's reads on the GPUs
    cpu_seconds: float  # one token's reads from host RAM
    cpu_seconds_per_extra_token: float  # matmul and attention compute on the CPU per token
    gpu_expert_bytes: tuple[tuple[int, float], ...] = ()  # (bytes, active fraction) per block
    cpu_expert_bytes: tuple[tuple[int, float], ...] = ()
    gpu_bandwidth: float = 1.0  # bytes/s
    host_bandwidth: float = 1.0  # the CPU's expert reads
    mapped_expert_bytes: tuple[tuple[int, float], ...] = ()  # misses the GPU reads from RAM
    mapped_bandwidth: float = 1.0

    def seconds(self, n_tokens: int) -> float:
        extra = max(0, n_tokens - 1)
        gpu = self.gpu_seconds * (1 + GPU_CHECK_TOKEN_FRACTION * extra)
        cpu = self.cpu_seconds + self.cpu_seconds_per_extra_token * extra
        gpu += _union_seconds(self.gpu_expert_bytes, n_tokens, self.gpu_bandwidth) \
            + _union_seconds(self.mapped_expert_bytes, n_tokens, self.mapped_bandwidth)
        cpu += _union_seconds(self.cpu_expert_bytes, n_tokens, self.host_bandwidth)
        return self.fixed_seconds + gpu + cpu

    def ratio(self, n_tokens: int) -> float:
        """A pass of n tokens over a pass of one."""
        return self.seconds(n_tokens) / self.seconds(1)


def _union_seconds(expert_bytes: tuple[tuple[int, float], ...], n_tokens: int,
                   bandwidth: float) -> float:
    """The extra reads of a pass of n tokens over one token's, for (bytes, active fraction)
    per block: each token routes to its own experts, so a pass reads the union of their
    choices, 1 - (1 - f)^n of the experts instead of f."""
    return sum(b * (1.0 - (1.0 - f) ** n_tokens - f) for b, f in expert_bytes) / bandwidth


@per_costs
def checking_terms(costs: ModelCosts, placement: Placement, settings: ContextSettings,
                   card: Card, n_threads: int | None = None,
                   depth: int = DECODE_DEPTH, pool: ExpertPool | None = None) -> CheckingCost:
    """The per-device terms of a checking pass of this placement at this depth, built on the
    decode prediction (its bytes per device, its CPU FLOPs). With an expert pool, the hits'
    share of a served block's experts is read on the GPU (the engine's pool serves checking
    passes, batches under 32 rows, as it serves decode)."""
    plain = predict_speed(costs, placement, settings, card, n_threads, depth, pool)
    devices = block_devices(costs, placement, card.n_gpus if card.has_gpu else 0)
    threads = decode_threads(card, n_threads)
    # the CPU's extra reads are experts'
    host_bw = expert_read_bps(card, threads, costs.expert_types)
    gpu_bw = card.bandwidth_gbs * 1e9 * card.decode_efficiency
    depth = min(depth, settings.n_ctx)
    cpu_attention = 0.0
    gpu_experts, cpu_experts, mapped_experts = [], [], []
    kept = in_ram(costs, placement)
    served, hits = pool_hits(costs, devices, kept, pool)
    attention = attention_row(costs, settings.type_k, settings.type_v, depth, False, card,
                              threads)
    for i in range(costs.n_blocks):
        if devices[i] == CPU:
            # CPU attention is compute over the cells (see attention_seconds): each token of
            # the pass attends again.
            cpu_attention += attention[i]
        if costs.expert_bytes[i]:
            on_cpu = devices[i] == CPU or bool(kept.experts[i])
            share = hits if i in served else 0.0  # of the union, what the pool holds
            misses = mapped_experts if i in served and pool.misses_on_gpu else \
                cpu_experts if on_cpu else gpu_experts
            misses.append((costs.expert_bytes[i] * (1.0 - share), costs.expert_active_fraction))
            if share:
                gpu_experts.append((costs.expert_bytes[i] * share, costs.expert_active_fraction))
    cpu_rate = threads * CPU_GFLOPS_PER_CORE * 1e9 * CPU_CHECK_EFFICIENCY
    per_token = plain.decode_flops_cpu / cpu_rate + cpu_attention
    fixed = 1.0 / plain.decode_tps - plain.decode_seconds_gpu - plain.decode_seconds_cpu
    return CheckingCost(fixed, plain.decode_seconds_gpu, plain.decode_seconds_cpu, per_token,
                        tuple(gpu_experts), tuple(cpu_experts), gpu_bw or 1.0, host_bw,
                        tuple(mapped_experts), mapped_bandwidth(card))


def checking_cost(costs: ModelCosts, placement: Placement, settings: ContextSettings, card: Card,
                  depth: int, n_tokens: int, n_threads: int | None = None) -> float:
    """Seconds of one pass that checks `n_tokens` (k drafts and the next token) at `depth`."""
    return checking_terms(costs, placement, settings, card, n_threads, depth).seconds(n_tokens)
