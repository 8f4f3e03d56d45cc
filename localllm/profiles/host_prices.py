"""This machine's own prices for the experts the CPU multiplies at decode, measured on first use
and kept (planner/host_reads.py expert_read_bps): its read rate by thread count, and ggml's
CPU expert kernels timed by ggml type and thread count.

The card table's host bandwidth is a guess for a box nobody measured (an H100's 16-core host
read Qwen3-30B-A3B's experts in RAM about 1.5x faster than it said, and the round trip to the
CPU was priced 3x too high, which made `expert_cache = auto` pick the slowest of its ways). So
the first plan for a GPU on this machine times its threads reading RAM, about a second (numpy's
reductions free the GIL, so Python threads stream in parallel, each over its own span, as
llama.cpp's threads split a tensor's rows). A read is not the kernel, though: another host read
as fast and multiplied its experts 1.66x slower than the read priced them, so the same first
plan also times ggml's own expert matmuls in a runner (engine/kernel_rates.py, a few seconds),
and a model whose expert types were timed is priced with them. Both go under `[host]` in the
calibration file, with when; every later plan reads them. `tune --json` names the source of
each price (prices_of).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path

from localllm.planner.card import Card
from .calibration import (
    HOST_KEY,
    KERNEL_KEY,
    KERNEL_WHEN_KEY,
    READ_KEY,
    READ_WHEN_KEY,
    SERVED_FACTOR_KEYS,
    SERVED_FROM_KEY,
    SERVED_WHEN_KEY,
    calibration_file,
    load_calibration,
    update_host,
)

log = logging.getLogger("localllm.tuner")
# What this process measured, by calibration file and cores: the daemon asks for its card
# several times a load, and a config it cannot write must not cost a measurement each time
_MEASURED: dict[tuple[str, int], tuple[tuple[int, float], ...]] = {}
_TIMED: dict[tuple[str, int], tuple] = {}  # the same for the expert kernels' rates
KERNEL_TIMEOUT_S = 120  # six types at each thread count: seconds on a 16-core host
BUFFER_BYTES = 512 << 20  # well past any last-level cache
REPEATS = 3


def thread_counts(cores: int) -> list[int]:
    """The thread counts worth measuring on `cores` cores: powers of two, the quarters in
    between, and all cores."""
    counts = {1, cores}
    n = 2
    while n < cores:
        counts.add(n)
        n *= 2
    counts.update(max(1, cores * q // 4) for q in (1, 2, 3))
    return sorted(counts)


def measure_read_gbs(threads: list[int], buffer_bytes: int = BUFFER_BYTES) -> dict[int, float]:
    """GB/s read by each of `threads` thread counts (the best of REPEATS passes)."""
    import numpy as np

    words = np.ones(buffer_bytes // 8, dtype=np.uint64)
    rates: dict[int, float] = {}
    for n in threads:
        spans = np.array_split(words, n)
        best = float("inf")
        for _ in range(REPEATS):
            workers = [threading.Thread(target=np.add.reduce, args=(span,)) for span in spans]
            start = time.perf_counter()
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            best = min(best, time.perf_counter() - start)
        rates[n] = round(words.nbytes / best / 1e9, 2)
    return rates


def measured_on_first_use(card: Card, path: Path | None = None,
                          buffer_bytes: int | None = None) -> Card:
    """This machine's card (as `calibrated` gives it, stored rates applied) with its read
    rates and its expert kernels' rates measured now and stored where none were. A card from
    a profile describes another box and is left as it is; so is a machine without a GPU, where
    every weight is read by the CPU and no plan weighs the CPU's reads against the GPU's."""
    if card.source != "probe" or not card.has_gpu:
        return card
    path = path or calibration_file()
    key = (str(path), card.cores)
    if not card.host_read_gbs:
        if key not in _MEASURED:  # once a process, even where the file could not be written
            _MEASURED[key] = _measure_and_store(card.cores, path, buffer_bytes)
        if _MEASURED[key]:
            card = replace(card, host_read_gbs=_MEASURED[key])
    if not card.host_expert_gbs:
        if key not in _TIMED:
            _TIMED[key] = _time_kernels_and_store(card.cores, path, buffer_bytes)
        if _TIMED[key]:  # the host factor served was of the read rate's price (as stored)
            card = replace(card, host_expert_gbs=_TIMED[key], served_host_factor=1.0)
    return card


def _measure_and_store(cores: int, path: Path,
                       buffer_bytes: int | None) -> tuple[tuple[int, float], ...]:
    started = time.monotonic()
    try:
        measured = measure_read_gbs(thread_counts(cores), buffer_bytes or BUFFER_BYTES)
    except MemoryError:
        log.warning("could not measure this machine's RAM read rate (no memory for the "
                    "buffer): experts in RAM are priced from the card table")
        return ()
    try:
        update_host({READ_KEY: {str(t): gbs for t, gbs in measured.items()},
                     READ_WHEN_KEY: time.strftime("%Y-%m-%dT%H:%M:%S")}, path)
    except OSError as e:  # a full disk or a read-only config: priced now, measured again later
        log.warning("could not save this machine's RAM read rate to %s: %s", path, e)
    log.info("measured this machine's RAM read rate in %.1f s: %s GB/s by threads",
             time.monotonic() - started, measured)
    return tuple(sorted(measured.items()))


def _time_kernels_and_store(cores: int, path: Path, buffer_bytes: int | None
                            ) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """ggml's CPU expert kernels timed in a runner of their own (engine/kernel_rates.py) and
    stored under `[host]`. The served-speed factor for the host goes with the old price: it
    said how far serving was from the read rate's price, which the kernels' rates replace."""
    from localllm.engine.probes import TimeKernels
    from localllm.engine.probing import ProbeFailed, ask

    started = time.monotonic()
    request = TimeKernels(tuple(thread_counts(cores)))
    if buffer_bytes:
        request = replace(request, buffer_bytes=buffer_bytes)
    try:
        timed = ask(request, timeout=KERNEL_TIMEOUT_S)
    except ProbeFailed as e:
        log.warning("could not time this machine's expert kernels (%s): experts in RAM are "
                    "priced from its read rate", e)
        return ()
    rates = timed.by_type()
    try:
        update_host({KERNEL_KEY: {name: {str(t): gbs for t, gbs in by_threads.items()}
                                  for name, by_threads in rates.items()},
                     KERNEL_WHEN_KEY: time.strftime("%Y-%m-%dT%H:%M:%S")}, path,
                    drop=("served_host_factor",))
    except OSError as e:
        log.warning("could not save this machine's expert kernel rates to %s: %s", path, e)
    log.info("timed this machine's expert kernels in %.1f s: %s GB/s by type and threads",
             time.monotonic() - started, rates)
    return tuple((name, tuple(sorted(by_threads.items()))) for name, by_threads in
                 sorted(rates.items()))


def prices_of(card: Card, path: Path | None = None) -> dict[str, dict]:
    """Each price the speed model reads of the machine, with where it came from: measured on
    this machine (and when) or assumed (the card table's, or an estimate)."""
    doc = load_calibration(path or calibration_file())
    host = doc.get(HOST_KEY, {}) if card.source == "probe" else {}
    entry = doc.get(card.name, {})
    return {
        "host_read_gbs": {
            "value": dict(card.host_read_gbs) if card.host_read_gbs else
            card.host_bandwidth_gbs,
            "source": f"measured on this machine at {host.get(READ_WHEN_KEY)}" if card.host_read_gbs
            and host.get(READ_WHEN_KEY) else "assumed: the host bandwidth of the card table or an "
            "estimate from the cores, shared out by threads"},
        "host_expert_gbs": {
            "value": {name: dict(rates) for name, rates in card.host_expert_gbs},
            "source": f"ggml's CPU kernels timed on this machine at {host.get(KERNEL_WHEN_KEY)}"
            if card.host_expert_gbs and host.get(KERNEL_WHEN_KEY) else "not timed: experts in "
            "RAM are priced from host_read_gbs"},
        "gpu_bandwidth_gbs": {
            "value": card.bandwidth_gbs,
            "source": f"measured by tune --calibrate at {entry['bandwidth_measured_at']}"
            if "bandwidth_measured_at" in entry else "assumed: the card table or NVML's peak"},
        "pcie_gbs": {
            "value": card.pcie_gbs,
            "source": f"measured by tune --calibrate at {entry['bandwidth_measured_at']}"
            if "bandwidth_measured_at" in entry else "assumed: the card table or the link's "
            "generation and width"},
        **{field: {
            "value": getattr(card, field),
            "source": f"measured serving {host.get(SERVED_FROM_KEY)} at "
            f"{host.get(SERVED_WHEN_KEY)}" if field in host and getattr(card, field) != 1.0
            else "assumed: 1.0, as priced (nothing served here was more than 15% off)"}
           for field in SERVED_FACTOR_KEYS},
        "disk_read_gbs": {
            "value": card.disk_read_gbs,
            "source": f"measured by tune --calibrate at {host['disk_measured_at']}"
            if card.disk_read_gbs and "disk_measured_at" in host else
            "the card profile's" if card.disk_read_gbs else "assumed"},
    }
