"""Saved profiles: the plan for a (card, model) pair as TOML a user may edit.

One file per pair in `<config dir>/profiles/`, named `<model>@<card>.toml`. The `[plan]` table
holds what the runner loads with; `[predicted]` and `[measured]` what the tuner expected and
what `localllm tune --measure` saw; `[[history]]` what happened (out-of-memory step-downs).
A file a user broke is reported with the reason (ProfileError) and never crashes a load.
"""

from __future__ import annotations

import re
import time
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomli_w

from localllm import paths
from localllm.errors import UserError
from localllm.kv_types import KV_TYPES

from localllm.speculative import ALIASES, SPECULATIVE_MODES, current_name


from localllm.planner.plan import Plan, TensorOverride

# Fields of Plan a profile may set, with their type; the rest are predictions and reasons.
EDITABLE: dict[str, type] = {
    "n_ctx": int, "n_gpu_layers": int, "type_k": str, "type_v": str, "flash_attn": bool,
    "swa_full": bool, "n_batch": int, "n_ubatch": int, "n_threads": int,
    "n_threads_batch": int, "use_mmap": bool, "pin_in_place": bool, "n_parallel": int,
    "speculative": str, "draft_n_max": int, "draft_n_gpu_layers": int, "streamed_bytes": int,
    "expert_cache": int, "expert_misses_on_gpu": bool, "expert_cache_swaps": int,
}
LIST_FIELDS = ("tensor_overrides", "tensor_split")
# Keys profiles saved before a rename still carry: read as the new name, written as it.
RENAMED = {"expert_cache_slots": "expert_cache"}
HEADER = """\
# localllm tuned profile. Edit any value under [plan]; the daemon uses this file for the
# model on this card and applies edits at the next load. Delete it to let the tuner plan again.
"""


class ProfileError(UserError):
    """A saved profile that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True)
class SavedProfile:
    path: Path
    model: str
    card: str
    model_size: int
    plan: Plan
    measured: dict[str, Any] = field(default_factory=dict)
    history: tuple[dict, ...] = ()


def profiles_dir() -> Path:
    return paths.config_dir() / "profiles"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def profile_path(model_name: str, card_name: str, directory: Path | None = None) -> Path:
    return (directory or profiles_dir()) / f"{_safe(model_name)}@{_safe(card_name)}.toml"


def plan_table(plan: Plan) -> dict:
    table: dict[str, Any] = {name: getattr(plan, name) for name in EDITABLE}
    table["tensor_overrides"] = [{"pattern": o.pattern, "device": o.device}
                                 for o in plan.tensor_overrides]
    table["tensor_split"] = list(plan.tensor_split)
    return table


def save_profile(plan: Plan, model_name: str, card_name: str, model_size: int,
                 measured: dict | None = None, history: tuple[dict, ...] = (),
                 directory: Path | None = None) -> Path:
    path = profile_path(model_name, card_name, directory)
    doc: dict[str, Any] = {
        "model": model_name, "card": card_name, "model_size": model_size,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "plan": plan_table(plan),
        "predicted": {
            "decode_tps": plan.predicted_decode_tps, "prefill_tps": plan.predicted_prefill_tps,
            "decode_by_depth": [list(x) for x in plan.predicted_decode_by_depth],
            "vram_bytes": plan.vram_bytes(), "ram_bytes": plan.ram_bytes(),
            "reasons": list(plan.reasons),
        },
    }
    if measured:  # TOML has no null: a figure not taken (no expert pool) is left out
        doc["measured"] = {k: v for k, v in measured.items() if v is not None}
    if history:
        doc["history"] = [dict(h) for h in history]
    write_toml(path, doc, HEADER)
    return path


def write_toml(path: Path, doc: dict, header: str = "") -> None:
    """Write a TOML file whole or not at all (a reader never sees half of it), 0600 in a 0700
    folder (a profile names the user's models)."""
    paths.private_dir(path.parent)
    paths.replace_private(path, header + tomli_w.dumps(doc))


def read_tables(path: Path) -> dict[str, dict]:
    """The top-level tables of a per-model results file; a missing or broken file has none
    (the figures are measured again)."""
    try:
        with paths.unless_broken(path, "the tuner's record"):
            doc = tomllib.loads(paths.read_regular(path).decode("utf-8"))
            return {k: v for k, v in doc.items() if isinstance(v, dict)}
    except OSError:
        pass
    return {}


def model_table(doc: dict[str, dict], model: str, file_size: int) -> dict:
    """A per-model results file's table for this model file: the one stored, or a new one
    where the file of that name changed (the figures stored describe other weights)."""
    entry = doc.get(model, {})
    return entry if entry.get("file_size") == file_size else {"file_size": file_size}


def _check(path: Path, key: str, value: Any, kind: type) -> Any:
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ProfileError(f"{path}: plan.{key} must be a whole number, not {value!r}")
    if kind is bool and not isinstance(value, bool):
        raise ProfileError(f"{path}: plan.{key} must be true or false, not {value!r}")
    if kind is str and not isinstance(value, str):
        raise ProfileError(f"{path}: plan.{key} must be text, not {value!r}")
    return value


def parse_plan_table(path: Path, table: Any) -> Plan:
    if not isinstance(table, dict):
        raise ProfileError(f"{path}: [plan] is missing")
    table = {**{RENAMED[k]: v for k, v in table.items() if k in RENAMED},  # the new name wins
             **{k: v for k, v in table.items() if k not in RENAMED}}
    known = set(EDITABLE) | set(LIST_FIELDS)
    unknown = sorted(set(table) - known)
    if unknown:
        raise ProfileError(f"{path}: unknown plan setting {unknown[0]!r} "
                           f"(known: {', '.join(sorted(known))})")
    if "n_ctx" not in table:
        raise ProfileError(f"{path}: plan.n_ctx is missing")
    values = {k: _check(path, k, v, EDITABLE[k]) for k, v in table.items() if k in EDITABLE}
    for key in ("type_k", "type_v"):
        if key in values and values[key] not in KV_TYPES:
            raise ProfileError(f"{path}: plan.{key} = {values[key]!r} is not a KV cache type "
                               f"({', '.join(KV_TYPES)})")
    if values["n_ctx"] < 256:
        raise ProfileError(f"{path}: plan.n_ctx must be at least 256")
    for key in ("n_batch", "n_ubatch", "n_threads", "n_threads_batch", "n_parallel"):
        if key in values and values[key] < 1:
            raise ProfileError(f"{path}: plan.{key} must be at least 1")
    if "speculative" in values:
        if values["speculative"] not in (*SPECULATIVE_MODES, *ALIASES):
            raise ProfileError(f"{path}: plan.speculative = {values['speculative']!r} is not one "
                               f"of {', '.join(SPECULATIVE_MODES)}")
        values["speculative"] = current_name(values["speculative"])
    for key in ("draft_n_max", "draft_n_gpu_layers", "expert_cache", "expert_cache_swaps"):
        if key in values and values[key] < 0:
            raise ProfileError(f"{path}: plan.{key} must be 0 or more")
    if values.get("type_v", "f16") != "f16" and not values.get("flash_attn", False):
        raise ProfileError(f"{path}: a quantized V cache (type_v = {values['type_v']!r}) needs "
                           "flash_attn = true")
    overrides = []
    for item in table.get("tensor_overrides", []):
        if not (isinstance(item, dict) and isinstance(item.get("pattern"), str)
                and isinstance(item.get("device"), str) and set(item) <= {"pattern", "device"}):
            raise ProfileError(f"{path}: each tensor_overrides entry needs a pattern and a "
                               "device, e.g. {pattern = '^output\\\\.weight$', device = 'CPU'}")
        try:
            re.compile(item["pattern"])
        except re.error as e:
            raise ProfileError(f"{path}: tensor override pattern {item['pattern']!r}: {e}") \
                from None
        overrides.append(TensorOverride(item["pattern"], item["device"]))
    split = table.get("tensor_split", [])
    if not isinstance(split, list) or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in split):
        raise ProfileError(f"{path}: tensor_split must be a list of non-negative numbers")
    return Plan(**values, tensor_overrides=tuple(overrides),
                tensor_split=tuple(float(x) for x in split), source=f"profile:{path}")


def load_profile(path: Path, set_aside_broken: bool = True) -> SavedProfile:
    """The profile at `path`; ProfileError with the file and reason when it cannot be used.
    One that is not TOML at all is set aside (a load re-tunes) unless `set_aside_broken` is
    False: the profile watcher's case, where the user may be in the middle of an edit."""
    try:
        doc = tomllib.loads(paths.read_regular(path).decode("utf-8"))
    except OSError as e:
        raise ProfileError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # not TOML or not UTF-8: set aside, re-tuned
        if not set_aside_broken:
            raise ProfileError(f"{path}: not valid TOML: {e}") from None
        paths.set_aside(path, "the saved profile", e)
        raise ProfileError(f"{path}: not valid TOML ({e}); set aside, the model is tuned "
                           "again") from None
    try:
        return _profile(path, doc)
    except ProfileError:
        raise
    except (TypeError, ValueError, AttributeError, OverflowError) as e:  # a value a user broke
        raise ProfileError(f"{path}: {type(e).__name__}: {e}") from None


def _profile(path: Path, doc: dict) -> SavedProfile:
    plan = parse_plan_table(path, doc.get("plan"))
    predicted = doc.get("predicted", {}) if isinstance(doc.get("predicted"), dict) else {}
    plan = replace(
        plan,
        predicted_decode_tps=float(predicted.get("decode_tps", 0.0) or 0.0),
        predicted_prefill_tps=float(predicted.get("prefill_tps", 0.0) or 0.0),
        reasons=(f"saved profile {path} (edit it to change the plan; delete it to re-tune)",),
    )
    history = doc.get("history", [])
    return SavedProfile(
        path=path, model=str(doc.get("model", "")), card=str(doc.get("card", "")),
        model_size=int(doc.get("model_size", 0) or 0), plan=plan,
        measured=dict(doc.get("measured", {})) if isinstance(doc.get("measured"), dict) else {},
        history=tuple(h for h in history if isinstance(h, dict)) if isinstance(history, list)
        else (),
    )


def find_profile(model_name: str, card_name: str,
                 directory: Path | None = None) -> SavedProfile | None:
    """The saved profile for the pair, None when there is none; ProfileError when it is broken."""
    path = profile_path(model_name, card_name, directory)
    if not path.is_file():
        return None
    return load_profile(path)


def record_event(model_name: str, card_name: str, event: str, plan: Plan | None = None,
                 directory: Path | None = None, model_size: int = 0) -> Path | None:
    """Append an event (an out-of-memory step-down) to the profile's history; when a new plan
    is given it replaces [plan], so the next load starts from what worked."""
    path = profile_path(model_name, card_name, directory)
    try:
        saved = load_profile(path) if path.is_file() else None
    except ProfileError:
        saved = None
    entry = {"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "event": event}
    history = (*(saved.history if saved else ()), entry)
    base = plan or (saved.plan if saved else None)
    if base is None:
        return None
    size = model_size or (saved.model_size if saved else 0)
    return save_profile(base, model_name, card_name, size, saved.measured if saved else None,
                        history, directory)


assert set(EDITABLE) <= {f.name for f in fields(Plan)}
