"""What the CPU's share of a decode step costs on this machine: the experts a GPU plan keeps in
RAM are read by the host's threads at its measured read rate (profiles/host_prices.py), and a
GPU plan decodes with the thread count that read fastest. The speed model (speed.py) and the
checking pass's price (checking.py) take their rates and threads from here."""

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


def expert_read_bps(card: Card, threads: int) -> float:
    """Bytes/s the CPU's `threads` threads multiply experts in RAM at, at decode: this machine's
    measured read rate at that thread count (card.host_read_gbs) where it was measured, else
    the card's host bandwidth shared out by threads."""
    if card.host_read_gbs:
        return max(1.0, HOST_READ_EFFICIENCY * 1e9 * read_gbs_at(card.host_read_gbs, threads))
    return card.host_bandwidth_gbs * 1e9 * threads / max(1, card.cores)


# A thread count below all cores is chosen for decode only where this machine read RAM this
# much faster with it: one measurement's noise must not move a plan.
FEWER_THREADS_GAIN = 1.05


def decode_threads(card: Card, n_threads: int | None = None) -> int:
    """The threads a GPU plan decodes with: `n_threads` where asked (num_thread); else the count
    at which this machine's measured read rate peaks (the CPU's share of a decode step, experts
    in RAM, is a read of them), where it beats all cores by FEWER_THREADS_GAIN; else all cores.
    On an H100 lease's 16-core host the rate fell from 72.5 GB/s at 12 threads to 48.9 at 16:
    one straggling thread holds up every step (lab/runs/h100-2026-12-07-moe-ways.md)."""
    if n_threads:
        return min(n_threads, card.cores)
    rates = {t: r for t, r in card.host_read_gbs if t <= card.cores}
    if not card.has_gpu or not rates:
        return card.cores
    best = max(rates, key=lambda t: (rates[t], t))
    at_all = read_gbs_at(card.host_read_gbs, card.cores)
    return best if rates[best] >= FEWER_THREADS_GAIN * at_all else card.cores


def read_gbs_at(rates: tuple[tuple[int, float], ...], threads: int) -> float:
    """A measured read rate at `threads`: linear between the thread counts measured, the
    nearest one's rate outside them."""
    points = sorted(rates)
    if threads <= points[0][0]:
        return points[0][1] * threads / points[0][0]
    for (t0, r0), (t1, r1) in zip(points, points[1:], strict=False):
        if threads <= t1:
            return r0 + (r1 - r0) * (threads - t0) / max(1, t1 - t0)
    return points[-1][1]
