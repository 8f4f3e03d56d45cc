"""What the CPU's share of a decode step costs on this machine: the experts a GPU plan keeps in
RAM are multiplied by the host's threads at the rate ggml's kernels were timed at here, else at
its measured read rate (profiles/host_prices.py), with one thread per physical core. The speed
model (speed.py) and the checking pass's price (checking.py) take their rates and threads from
here."""

from __future__ import annotations

from .card import Card


# Priced with this machine's measured read rate (profiles/host_prices.py): llama.cpp's
# expert matmuls at decode (the experts of blocks kept in RAM, batch 1) stream their weights at
# this share of it, and each such block pays a round trip of the hidden state. Fitted on an
# H100's 16-core host (tests/fixtures/h100-moe-prices.json): Qwen3-30B-A3B with the experts of
# 12-48 blocks in RAM at 8, 12 and 16 threads, at depth 0 and 16K, within 8% (llama-bench; the
# host read 12-79 GB/s from 1 to 16 threads).
HOST_READ_EFFICIENCY = 0.95
# The hidden state's trip to the CPU and back for a block whose experts are in RAM, priced with
# the measured read rate (unmeasured, a trip is two CROSSING_SECONDS, fitted with the card
# table's rate on the H200: together they priced the H100's experts in RAM 1.5-2x too slow).
EXPERT_ROUND_TRIP_SECONDS = 0.06e-3


def expert_read_bps(card: Card, threads: int,
                    expert_types: tuple[tuple[str, float], ...] = ()) -> float:
    """Bytes/s the CPU's `threads` threads multiply experts in RAM at, at decode: where ggml's
    kernels were timed on this machine for every type of the model's experts (`expert_types`,
    share of bytes by ggml type; card.host_expert_gbs), their rates, the bytes of each type at
    its own; else this machine's measured read rate at that thread count (card.host_read_gbs);
    else the card's host bandwidth shared out by threads."""
    kernel = kernel_bps(card, threads, expert_types)
    if kernel:
        return kernel
    if card.host_read_gbs:
        return max(1.0, HOST_READ_EFFICIENCY * 1e9 * read_gbs_at(card.host_read_gbs, threads))
    return card.host_bandwidth_gbs * 1e9 * threads / max(1, card.cores)


def kernel_bps(card: Card, threads: int, expert_types: tuple[tuple[str, float], ...]) -> float:
    """The timed kernels' rate for experts of `expert_types` at `threads` (a byte of each type
    at its type's rate); 0.0 where any of the types was not timed here."""
    timed = dict(card.host_expert_gbs)
    if not expert_types or any(name not in timed for name, _ in expert_types):
        return 0.0
    seconds_per_byte = sum(share / (1e9 * read_gbs_at(timed[name], threads))
                           for name, share in expert_types)
    return 1.0 / max(seconds_per_byte, 1e-15)


def decode_threads(card: Card, n_threads: int | None = None) -> int:
    """The threads a plan decodes with: `n_threads` where asked (num_thread), else every
    physical core. A read-rate probe that peaked below all cores once chose fewer: on an H100
    lease's 16-core host it read 72.5 GB/s with 12 threads and 48.9 with 16, and the plan it
    chose decoded 97 tok/s with 12 where the same plan decoded 104-108 with 16 (lab/runs/
    h100-2026-12-07b-moe-ways.md); llama-bench on another lease's host rose from 80.7 to 88.0
    tok/s from 12 to 16 threads (tests/fixtures/h100-moe-prices.json). Python's threads
    contend where llama.cpp's do not, so the probe prices reads, not thread counts."""
    if n_threads:
        return min(n_threads, card.cores)
    return card.cores


def read_gbs_at(rates: tuple[tuple[int, float], ...], threads: int) -> float:
    """A measured read rate at `threads`: linear between the thread counts measured, the
    nearest one's rate outside them, and never below what fewer threads read (the engine's
    threads reach what some of them do; a dip at more threads is the probe's own contention,
    decode_threads)."""
    points, best = [], 0.0
    for t, r in sorted(rates):
        best = max(best, r)
        points.append((t, best))
    if threads <= points[0][0]:
        return points[0][1] * threads / points[0][0]
    for (t0, r0), (t1, r1) in zip(points, points[1:], strict=False):
        if threads <= t1:
            return r0 + (r1 - r0) * (threads - t0) / max(1, t1 - t0)
    return points[-1][1]
