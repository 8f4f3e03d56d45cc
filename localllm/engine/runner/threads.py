"""Decode threads on a shared CPU: fewer threads when other processes take cores.

llama.cpp's threads meet at a barrier after every operation of a decode step, so one thread
whose core another process holds stalls all the others: on 2 cores with a 1-core hog, SmolLM2
planned at 2 threads decoded at 0.5-5 tok/s, 1 thread at 46-87. The plan chose its threads for
an idle machine; this module watches what the host does while the runner decodes.

Once per window of decode steps it compares the measured step time with the plan's predicted
one at the window's context depth (the plan's curve: a session average would hide a 4x stall
early in a context, where decode is fastest), and the host's busy CPU time (/proc/stat, over
the cores this process may run on) with the runner's own (os.times): what is left is the other
processes' load, in cores. When decode runs below the plan while others hold cores, one thread
less is tried for a window (never below the cores the others leave, at least one): kept when
it decodes faster, taken back otherwise (and not tried again for a while). How much a hog
costs depends on the kernel's scheduling: on one 2-core machine 2 threads fell to 0.5-5 tok/s
against 46-87 for one, on another to 23-36 against 29-42, so the trial measures rather than
predicts. When the others have left for a few windows, a thread comes back, up to the plan's
count. Sampling reads two small files per window: nothing per token.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("localllm.runner")

WINDOW_S = 1.0  # decode time between two looks at the host
IDLE_RESET_S = 2.0  # a gap longer than this between steps starts a new window (no decode)
SLOW = 0.8  # decode below this part of the expected speed is worth a trial with a thread less
KEEP_GAIN = 1.05  # the trial's decode must beat the window before it by this much to stay
HOLD_WINDOWS = 8  # windows after a trial that did not pay before the next one
BUSY_CORES = 0.5  # other processes using this many cores or more: the host is busy
QUIET_WINDOWS = 3  # windows with a core free beside ours before a thread comes back


@dataclass(frozen=True)
class CpuSample:
    wall_s: float
    host_busy_s: float  # busy CPU time of our cores, every process together
    own_s: float  # this process's CPU time (all its threads, spin-waits included)


def our_cpus() -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return tuple(range(os.cpu_count() or 1))


def read_sample(cpus: tuple[int, ...]) -> CpuSample | None:
    """Now's counters; None where /proc/stat cannot be read (then nothing adapts)."""
    wanted = {f"cpu{c}" for c in cpus}
    tick = os.sysconf("SC_CLK_TCK")
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in wanted:
                    # user nice system idle iowait irq softirq steal: all but idle and iowait
                    values = [int(x) for x in fields[:8]]
                    busy += sum(values) - values[3] - values[4]
    except (OSError, ValueError, IndexError):
        return None
    times = os.times()
    return CpuSample(time.monotonic(), busy / tick, times.user + times.system)


def others_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy between two samples, on average."""
    wall = after.wall_s - before.wall_s
    if wall <= 0:
        return 0.0
    theirs = (after.host_busy_s - before.host_busy_s) - (after.own_s - before.own_s)
    return max(0.0, theirs / wall)


@dataclass(frozen=True)
class ThreadChange:
    n_threads: int
    reason: str
    trial: bool = False  # a thread less for one window, to be kept or taken back


class ThreadGovernor:
    """Decides the decode threads from the step times the engine reports (`observe`)."""

    def __init__(self, planned: int, predicted_tps: float,
                 by_depth: tuple[tuple[int, float], ...] = (),
                 cpus: tuple[int, ...] | None = None,
                 sample: Callable[[tuple[int, ...]], CpuSample | None] = read_sample,
                 clock: Callable[[], float] = time.monotonic):
        """`predicted_tps` is the plan's speed where `by_depth` ((tokens in context, tok/s),
        the plan's curve) is empty; `sample` and `clock` read the host (tests pass counters of
        their own)."""
        self.planned = max(1, planned)
        self.n_threads = self.planned
        self.predicted_tps = predicted_tps
        self.by_depth = tuple(sorted(by_depth))
        self.cpus = cpus or our_cpus()
        self._sample = sample
        self._clock = clock
        self._start: CpuSample | None = None
        self._steps: list[float] = []
        self._depths: list[int] = []
        self._last_step = 0.0
        self._quiet = 0
        self._best_tps = 0.0  # the fastest window yet (no plan figure to compare with)
        self._best_ratio = 1.0  # the fastest window against the plan at its depth, 1 at least
        self._trial_from: float | None = None  # the decode speed before a trial, during one
        self._hold = 0

    def observe(self, step_s: float, depth: int = 0) -> ThreadChange | None:
        """One decode step's time at `depth` tokens of context; a change of threads when this
        window ends in one."""
        now = self._clock()
        if self._start is None or now - self._last_step > IDLE_RESET_S:
            self._start, self._steps, self._depths = self._sample(self.cpus), [], []
        self._last_step = now
        self._steps.append(step_s)
        self._depths.append(depth)
        if self._start is None or now - self._start.wall_s < WINDOW_S:
            return None
        end = self._sample(self.cpus)
        if end is None:
            return None
        measured_tps = 1.0 / max(statistics.median(self._steps), 1e-9)
        others = others_cores(self._start, end)
        predicted = self.predicted_at(int(statistics.median(self._depths)))
        self._start, self._steps, self._depths = end, [], []
        return self._decide(measured_tps, others, predicted)

    def predicted_at(self, depth: int) -> float:
        """The plan's decode speed at `depth` tokens of context (linear between its points)."""
        if not self.by_depth:
            return self.predicted_tps
        points = self.by_depth
        if depth <= points[0][0]:
            return points[0][1]
        for (d0, t0), (d1, t1) in zip(points, points[1:], strict=False):
            if depth <= d1:
                return t0 + (t1 - t0) * (depth - d0) / max(d1 - d0, 1)
        return points[-1][1]

    def _decide(self, measured_tps: float, others: float,
                predicted: float) -> ThreadChange | None:
        self._best_tps = max(self._best_tps, measured_tps)
        # What this runner decodes at this depth when it is not slowed: the plan's figure, or
        # above it as fast as a window has already gone (a plan that undersells this machine
        # would otherwise hide a slowdown); only windows with the host quiet count.
        if predicted > 0 and others < BUSY_CORES:
            self._best_ratio = max(self._best_ratio, measured_tps / predicted)
        expected = predicted * self._best_ratio if predicted > 0 else self._best_tps
        whose = "the plan's" if self._best_ratio == 1.0 else "this machine's"
        # The cores the others leave us (a core they use 0.8 of counts as theirs).
        left = max(1, len(self.cpus) - math.ceil(others - 0.25))
        if self._trial_from is not None:
            before, self._trial_from = self._trial_from, None
            n = self.n_threads
            if measured_tps >= KEEP_GAIN * before:
                self._quiet = 0
                return ThreadChange(n, (
                    f"decode at {measured_tps:.1f} tok/s with {_threads(n)} against "
                    f"{before:.1f} with {n + 1} ({whose} {expected:.1f}), while other "
                    f"processes use {others:.1f} of {len(self.cpus)} cores: "
                    f"{n + 1} -> {_threads(n)}"))
            self.n_threads, self._hold = n + 1, HOLD_WINDOWS
            return ThreadChange(n + 1, (
                f"a trial with {_threads(n)} decoded at {measured_tps:.1f} tok/s against "
                f"{before:.1f} with {n + 1}: back to {n + 1}"), trial=True)
        self._hold = max(0, self._hold - 1)
        if others >= BUSY_CORES and measured_tps < SLOW * expected and self.n_threads > left \
                and not self._hold:
            self._quiet = 0
            self._trial_from = measured_tps
            self.n_threads -= 1
            return ThreadChange(self.n_threads, (
                f"decode at {measured_tps:.1f} tok/s, under {SLOW:.0%} of {whose} "
                f"{expected:.1f}, while other processes use {others:.1f} of "
                f"{len(self.cpus)} cores: trying {_threads(self.n_threads)}"), trial=True)
        if self.n_threads < self.planned and left > self.n_threads:
            self._quiet += 1
            if self._quiet >= QUIET_WINDOWS:
                self._quiet = 0
                self.n_threads += 1
                return ThreadChange(self.n_threads, (
                    f"other processes use {others:.1f} of {len(self.cpus)} cores again: "
                    f"{self.n_threads - 1} -> {self.n_threads} threads (the plan has "
                    f"{self.planned})"))
        else:
            self._quiet = 0
        return None


def _threads(n: int) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"
