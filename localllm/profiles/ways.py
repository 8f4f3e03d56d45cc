"""Each way's decode measured while serving, per model file, for the tuner (issue #65).

Where `auto` finds an MoE model's ways priced too close to trust (planner/ways.py), the daemon
measures the one it runs: once an answer brings the plan's served-speed check to
MIN_CHECK_TOKENS decoded alone (profiles/served.py), the decode it measured, carried to the
plan's own depth (the plan's predicted decode over the check's measured/predicted ratio), is
stored here under what it was measured under (card, free VRAM, context: ways.situation), and
the next plan reads it. Stored in `<config dir>/profiles/ways.toml`, one table per model.
"""

from __future__ import annotations

import time
from pathlib import Path

from .saved import model_table, profiles_dir, read_tables, write_toml


def ways_file() -> Path:
    return profiles_dir() / "ways.toml"


def record(model: str, file_size: int, situation: str, way: str, tps: float, tokens: int,
           path: Path | None = None) -> None:
    """`way` decoded `tps` over `tokens` serving `model` under `situation`; it replaces what
    was stored for that way there (the newest measurement, on this machine as it is now)."""
    if not situation or not way or tps <= 0:
        return
    path = path or ways_file()
    doc = read_tables(path)
    entry = model_table(doc, model, file_size)
    measured = entry.get(situation)
    measured = measured if isinstance(measured, dict) else {}
    measured[way] = {"tps": round(tps, 2), "tokens": tokens,
                     "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    entry[situation] = measured
    doc[model] = entry
    write_toml(path, doc)


def measured_ways(model: str, file_size: int, path: Path | None = None
                  ) -> dict[str, dict[str, float]]:
    """{situation: {way: tok/s}} measured serving this model file; {} where none was."""
    entry = model_table(read_tables(path or ways_file()), model, file_size)
    out: dict[str, dict[str, float]] = {}
    for situation, ways in entry.items():
        if not isinstance(ways, dict):
            continue
        for way, figures in ways.items():
            try:
                tps = float(figures["tps"])
            except (KeyError, TypeError, ValueError):
                continue
            if tps > 0:
                out.setdefault(situation, {})[way] = tps
    return out
