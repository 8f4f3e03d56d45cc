"""What the daemon does when a runner dies on its own: the log keeps what ran and what the
runner said last, so the crash can be reported, and a model whose runner crashed twice with one
risky part of its plan on loads the next time with that part off, most recent first: the expert
cache's pool, then its misses read by the GPU from RAM. An engine that crashed while loading
with llama.cpp's extra buffer types on loads that model without them (daemon/starting.py).

Each note is the model's alone, and about one setting: other models load as planned. A note
whose setting did not help (the runner crashed with it off too: the model is at fault, not the
setting) is dropped, and the setting is on again at the next load. A SIGKILL the daemon did not
send (the kernel's OOM killer, `kill -9`) is not the engine's crash and counts for nothing.
`ps` shows the notes of the models loaded; `POST /api/crashes/forget` (`localllm ps
--forget-crashes`) drops them.

Requests are not this module's: the response pipeline asks again a request whose runner died
before its first token (daemon/api/respond.py), and the runner's other requests end with the
error.
"""

from __future__ import annotations

import logging
import signal
from collections import Counter
from dataclasses import replace
from pathlib import Path

from localllm.planner.plan import Plan

log = logging.getLogger("localllm.scheduler")

CRASHES_BEFORE_SAFER = 2  # crashes with a part on before a load goes without it
LOG_LINES = 40  # of the runner's log, kept in the daemon's log with each crash


def risk(plan: Plan) -> str:
    """The riskiest part of the plan still on: "pool", "mapped misses", or "" (none)."""
    if plan.expert_cache and plan.expert_misses_on_gpu:
        return "mapped misses"
    if plan.expert_cache:
        return "pool"
    return ""


def without(part: str, plan: Plan, why: str) -> Plan:
    """`plan` with `part` off and `why` among its reasons."""
    if part == "mapped misses":
        return replace(plan, expert_misses_on_gpu=False, reasons=(*plan.reasons, why))
    return replace(plan, expert_cache=0, expert_misses_on_gpu=False,
                   reasons=(*plan.reasons, why))


def log_tail(path: Path, lines: int = LOG_LINES) -> str:
    """The last `lines` lines of a runner's log ("" when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def summary(plan: Plan) -> str:
    """The plan in one line, for a crash report."""
    return (f"context {plan.n_ctx}, {plan.n_gpu_layers} GPU layers, KV {plan.type_k}/"
            f"{plan.type_v}, {plan.n_parallel} slots, batch {plan.n_batch}/{plan.n_ubatch}, "
            f"expert pool {plan.expert_cache} slots"
            + (", misses on the GPU" if plan.expert_misses_on_gpu else "")
            + (f", overrides {len(plan.tensor_overrides)}" if plan.tensor_overrides else ""))


class Crashes:
    """Crashes of each model's runners, by the riskiest part of the plan that ran, and the
    settings each model's loads leave off because of them."""

    def __init__(self):
        self.counts: Counter[tuple[str, str]] = Counter()
        self.off: dict[str, list[str]] = {}  # model -> the parts safer() turned off, in order
        self.notes: dict[str, str] = {}  # model -> what its next loads leave off, for ps
        # model -> why its loads go without llama.cpp's extra buffer types (starting.py)
        self.no_extra_bufts: dict[str, str] = {}

    def record(self, model: str, plan: Plan, why: str, log_path: Path,
               code: int | None = None) -> None:
        """A runner of `model` died running `plan`; `code` its exit code (None: the daemon
        ended it, hung or garbled, which is the engine's fault too)."""
        if code == -signal.SIGKILL:
            log.warning("the runner for %s was killed from outside (SIGKILL: the kernel's OOM "
                        "killer or kill -9) running: %s; not counted as a crash of the engine",
                        model, summary(plan))
            return
        part = risk(plan)
        self.counts[(model, part)] += 1
        log.warning("the runner for %s died (%s) running: %s. Its log (%s) ended:\n%s",
                    model, why, summary(plan), log_path, log_tail(log_path))
        if not part and self.off.get(model):  # everything risky was off, and it crashed
            parts = self.off.pop(model)
            for gone in parts:
                self.counts.pop((model, gone), None)
            self.notes.pop(model, None)
            log.warning("%s: its runner crashed with the expert cache's %s off too, so that was "
                        "not the cause; the next load has it on again", model,
                        " and ".join(parts))
        elif part and self.counts[(model, part)] == CRASHES_BEFORE_SAFER:
            log.warning("%s: its runner crashed %d times with the expert cache's %s on; the "
                        "next load goes without it", model, CRASHES_BEFORE_SAFER, part)

    def safer(self, model: str, plan: Plan,
              bands: tuple[Plan, ...]) -> tuple[Plan, tuple[Plan, ...]]:
        """The plan and bands to load `model` with: each part whose crashes reached
        CRASHES_BEFORE_SAFER off, most recent first."""
        while (part := risk(plan)) and self.counts[(model, part)] >= CRASHES_BEFORE_SAFER:
            why = (f"the expert cache's {part} off: the runner crashed "
                   f"{self.counts[(model, part)]} times with it on")
            self.notes[model] = why
            if part not in self.off.setdefault(model, []):
                self.off[model].append(part)
            plan = without(part, plan, why)
            bands = tuple(without(part, b, why) if risk(b) == part else b for b in bands)
        return plan, bands

    def note(self, model: str) -> str:
        """What `model`'s loads leave off because its runners crashed ("" when nothing)."""
        return "; ".join(n for n in (self.no_extra_bufts.get(model), self.notes.get(model))
                         if n)

    def forget(self, model: str | None = None) -> list[str]:
        """Drop the crash counts and notes of `model` (every model's when None): its next load
        runs the plan as made. The models that had notes, sorted."""
        noted = {m for m in (*self.notes, *self.no_extra_bufts, *self.off)
                 if model is None or m == model}
        self.counts = Counter({k: n for k, n in self.counts.items()
                               if model is not None and k[0] != model})
        for table in (self.notes, self.no_extra_bufts, self.off):
            for m in [m for m in table if model is None or m == model]:
                del table[m]
        if noted:
            log.info("crash notes forgotten for %s", ", ".join(sorted(noted)))
        return sorted(noted)
