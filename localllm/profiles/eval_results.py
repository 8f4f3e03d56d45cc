"""`localllm eval` results as they are kept: the KL divergence each KV setting cost a model,
in `<config dir>/profiles/quality.toml`, one table per model (the policy that reads them is
planner.quality)."""

from __future__ import annotations

import time
from pathlib import Path

from localllm.paths import unless_broken

from localllm.planner.quality import REFERENCE
from .saved import model_table, profiles_dir, read_tables, write_toml

def results_file() -> Path:
    return profiles_dir() / "quality.toml"


def save_result(model: str, file_size: int, setting: str, reference: str, metrics: dict,
                path: Path | None = None) -> Path:
    """Store one eval result under the model; a result for another file of the same name
    replaces the model's table (the old figures described other weights)."""
    path = path or results_file()
    doc = read_tables(path)
    entry = model_table(doc, model, file_size)
    table = "kv" if reference == REFERENCE else "vs"
    key = setting if table == "kv" else reference
    results = {}
    with unless_broken(path, "the eval results"):
        results = dict(entry.get(table, {}))
    if not path.exists():  # set aside: a fresh file
        doc, entry = {}, {"file_size": file_size}
    results[key] = {**{k: round(float(v), 6) for k, v in metrics.items()},
                    "setting": setting, "reference": reference,
                    "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    entry[table] = results
    doc[model] = entry
    write_toml(path, doc)
    return path


def measured_kl(model: str, file_size: int, path: Path | None = None) -> dict[str, float]:
    """{KV label: mean KL vs f16} measured for this model file; empty when none is."""
    entry = model_table(read_tables(path or results_file()), model, file_size)
    out = {}
    kv = entry.get("kv", {})
    for label, result in (kv.items() if isinstance(kv, dict) else ()):
        if isinstance(result, dict) and isinstance(result.get("kl_mean"), (int, float)):
            out[label] = float(result["kl_mean"])
    return out
