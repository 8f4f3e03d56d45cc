"""What each model was asked: the lengths of the prompts and answers it served, for the tuner.

A workload the user must name is a setting nobody sets, while the daemon sees every request. So
it keeps, per model, the last KEEP requests as (prompt tokens, tokens of it read, answer tokens),
and the next load of that model is planned for that mix (planner.workload.learned). Before
there is enough of a record, the workload comes from the config (`workload = chat|agent`), or,
with `auto`, from the route that asked: Anthropic's /v1/messages, OpenAI's /v1/responses and
requests with tools are agents' (a long system prompt, tool results turn after turn).

The record is a small JSON file in the state directory, owner-only (it says how long the
user's prompts are): at most MAX_MODELS models (the least recently used go), KEEP requests
each, a few KB in all.

    record(model, prompt, read, answer)          the daemon, after each answer
    starting_workload(setting, model, hint)      -> Workload and where it came from
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from localllm import paths

from localllm.planner.workload import CHAT, MIN_LEARNED, Workload, learned, named

log = logging.getLogger(__name__)

KEEP = 24  # requests per model: the recent mix, not the history
MAX_MODELS = 8
AGENT_ROUTES = ("/v1/messages", "/v1/responses")


def traffic_file() -> Path:
    return paths.state_dir() / "workload.json"


def _read(path: Path) -> dict[str, list[list[int]]]:
    """The record; {} when there is none, or when it is broken (then set aside: any content,
    localllm.paths)."""
    try:
        with paths.unless_broken(path, "the workload record"):
            return _parse(paths.read_regular(path).decode("utf-8"))
    except FileNotFoundError:
        return {}
    except OSError as e:
        log.warning("workload record %s unreadable (%s)", path, e)
    return {}


def _parse(text: str) -> dict[str, list[list[int]]]:
    doc = json.loads(text)
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), dict):
        raise ValueError("not a workload record")
    out = {}
    for name, rows in doc["models"].items():
        if isinstance(rows, list):
            out[str(name)] = [[int(x) for x in r] for r in rows
                              if isinstance(r, list) and len(r) == 3
                              and all(isinstance(x, int) and 0 <= x < 1 << 40 for x in r)
                              ][-KEEP:]
    return out


def record(model: str, prompt: int, read: int, answer: int, path: Path | None = None) -> None:
    """Add one served request to the model's record (its least recent one leaves past KEEP;
    the least recently used model leaves past MAX_MODELS)."""
    if prompt <= 0:
        return
    path = path or traffic_file()
    models = _read(path)
    rows = models.pop(model, [])
    rows.append([int(prompt), int(min(max(0, read), prompt)), int(max(0, answer))])
    models[model] = rows[-KEEP:]
    while len(models) > MAX_MODELS:
        models.pop(next(iter(models)))
    path.parent.mkdir(parents=True, exist_ok=True)
    paths.replace_private(path, json.dumps({"models": models}, separators=(",", ":")))


def served(model: str, path: Path | None = None) -> list[tuple[int, int, int]]:
    """The model's recorded requests, oldest first."""
    return [tuple(r) for r in _read(path or traffic_file()).get(model, [])]


def starting_workload(setting: str, model: str | None = None, hint: str | None = None,
                      path: Path | None = None) -> tuple[Workload, str]:
    """The workload to plan `model`'s next load for, and where it came from: the record once
    it holds MIN_LEARNED requests; before that the config's named workload, else (`auto`) the
    route's hint, else chat."""
    requests = served(model, path) if model else []
    mix = learned(requests)
    if mix is not None:
        return mix, f"learned from {len(requests)} requests"
    since = f" ({len(requests)} of {MIN_LEARNED} requests recorded)" if requests else ""
    if setting != "auto":
        return named(setting), f"config (workload = {setting}){since}"
    if hint:
        return named("agent"), f"route hint ({hint}){since}"
    return CHAT, f"default (chat){since}"


def route_hint(path: str, has_tools: bool) -> str | None:
    """What a request says about its session before any record exists: the agents' routes, or
    tools in the request."""
    if path in AGENT_ROUTES:
        return path
    return "tools" if has_tools else None
