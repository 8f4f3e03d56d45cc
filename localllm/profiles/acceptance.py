"""Draft acceptance measured while serving, per model file and speculative mode, for the tuner.

The tuner plans speculation at an assumed acceptance per mode (speculation.py) until the model
has drafted enough here with that mode; then the measured rate plans its next load, so a mode
that does not pay on what this user asks of this model is turned off (and one that pays more
than assumed gets longer drafts). Counts are halved past DECAY_AT drafted tokens, so the figure
follows recent use. Stored in `<config dir>/profiles/acceptance.toml`, one table per model.
"""

from __future__ import annotations

from pathlib import Path

from localllm.speculative import DRAFTING_MODES
from localllm.paths import unless_broken

from .saved import model_table, profiles_dir, read_tables, write_toml

MIN_DRAFTED = 256  # drafted tokens before a measured rate replaces the assumed one
DECAY_AT = 4096


def acceptance_file() -> Path:
    return profiles_dir() / "acceptance.toml"


def record(model: str, file_size: int, mode: str, drafted: int, accepted: int,
           path: Path | None = None) -> None:
    """Add drafts to the model's counts (a new file of the same name starts them again)."""
    if mode not in DRAFTING_MODES or drafted <= 0:
        return
    path = path or acceptance_file()
    doc = read_tables(path)
    entry = model_table(doc, model, file_size)
    counts = {}
    with unless_broken(path, "the draft acceptance record"):  # the counts so far, if sound
        old = entry.get(mode, {})
        counts = {"drafted": int(old.get("drafted", 0)), "accepted": int(old.get("accepted", 0))}
    if not counts:  # set aside: a fresh record
        doc, entry, counts = {}, {"file_size": file_size}, {"drafted": 0, "accepted": 0}
    total = counts["drafted"] + drafted
    taken = counts["accepted"] + min(accepted, drafted)
    if total > DECAY_AT:
        total, taken = total // 2, taken // 2
    entry[mode] = {"drafted": total, "accepted": taken}
    doc[model] = entry
    write_toml(path, doc)


def measured_acceptance(model: str, file_size: int, path: Path | None = None
                        ) -> dict[str, float]:
    """{mode: accepted / drafted} for the modes this model file has drafted enough with."""
    path = path or acceptance_file()
    entry = model_table(read_tables(path), model, file_size)
    with unless_broken(path, "the draft acceptance record"):
        out = {}
        for mode in DRAFTING_MODES:
            counts = entry.get(mode)
            if isinstance(counts, dict) and int(counts.get("drafted", 0)) >= MIN_DRAFTED:
                out[mode] = min(1.0, max(0.0, int(counts.get("accepted", 0)) /
                                         int(counts["drafted"])))
        return out
    return {}
