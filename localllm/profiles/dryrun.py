"""Dry-run loads: llama.cpp's own compute buffer sizes for a plan, without allocating anything.

A dry run creates a CUDA context, so it runs in the engine's child program (the runner's
engine/runner/tuner_ops.py runs engine/dryrun.py, which builds the model and context exactly as a
runner's load does): the daemon never holds GPU memory of its own. Results are cached per model
file and load settings in the cache dir, so a model is probed once per setting.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from localllm import paths

from localllm.planner.card import Card
from localllm.planner.costs import ModelCosts
from localllm.planner.memory import CPU, ContextSettings, memory_by_device
from localllm.planner.placements import Placement
from localllm.planner.plan import Plan
from localllm.engine.probes import Buffers, DryRun
from localllm.engine.probing import ProbeFailed, ask


def _cache_file(model_path: str, plan: Plan) -> Path:
    st = os.stat(model_path)
    key = json.dumps([os.path.abspath(model_path), st.st_size, int(st.st_mtime),
                      repr(plan.load_key()), os.environ.get("LLAMA_CPP_LIB_PATH", "")])
    return paths.cache_dir() / "dryrun" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def dry_run(model_path: str, plan: Plan, timeout: float = 120.0) -> Buffers | None:
    """llama.cpp's buffers for this plan, from the cache or a child process; None when the dry
    run failed (the formula stands in)."""
    cache = _cache_file(model_path, plan)
    if cache.is_file():
        try:
            with paths.unless_broken(cache, "a cached dry run"):
                found = json.loads(paths.read_regular(cache).decode("utf-8"))
                if not isinstance(found, dict) or not isinstance(found.get("compute", {}), dict):
                    raise ValueError("not a dry run's figures")
                return Buffers(**found)
        except (OSError, TypeError):
            pass
    try:
        result = ask(DryRun(model_path, plan), timeout)
    except (OSError, ProbeFailed):
        return None
    if not result.compute:
        return None
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(asdict(result)))
    return result


def with_pool_bound(compute: dict[str, int], plan: Plan, costs: ModelCosts,
                    placement: Placement, settings: ContextSettings, card: Card) -> dict[str, int]:
    """A dry run's compute buffers, where the plan has an expert pool on a GPU raised to the
    formula's bound for the graph the pool makes.

    A dry run loads no weights, and the engine makes no pool for such a model (patches/0002),
    so it measures the graph without one: a prompt batch copying a RAM block's experts to the
    GPU (op offload). The runner's context has the pool, and llama.cpp reserves more for its
    graph. On the H200 a Qwen3-30B-A3B band at 32K context and micro-batch 2048 reserved 1,337
    MiB on the GPU where its dry run said 1,203; the formula without the copy's room (the
    activations of a micro-batch and flash attention's mask) says 1,397 (docs/gpu-suite.md)."""
    if not plan.expert_cache or plan.expert_cache_device == "cpu":
        return compute
    bound = {m.device: m.compute
             for m in memory_by_device(costs, placement, settings, card, op_offload=False)}
    return {d: v if d == CPU else max(v, bound.get(d, 0)) for d, v in compute.items()}
