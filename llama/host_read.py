"""How fast this machine's cores read RAM, by thread count: the price of weights the CPU
multiplies at decode (experts in RAM, blocks on the CPU).

A decode step on the CPU streams each weight it uses once, so it is bound by how fast the
threads read memory, and that rate is the machine's, not the card table's: a 16-core host of an
H100 read Qwen3-30B-A3B's experts at about 130 GB/s where a desktop's two channels cap near 60.
Measured here in about a second (numpy's reductions free the GIL, so Python threads stream in
parallel, each over its own span, as llama.cpp's threads split a tensor's rows), once per
machine; profiles/tuning/host_prices.py keeps the figures.
"""

from __future__ import annotations

import threading
import time

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
