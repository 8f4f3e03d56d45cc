"""Dry-run loads: llama.cpp's own compute buffer sizes for a plan, without allocating anything.

A dry run creates a CUDA context, so it runs in the engine's child program (llama/probe.py;
llama/dryrun.py builds the model and context exactly as the runner does): the daemon never
holds GPU memory of its own. Results are cached per model file and load settings in the cache
dir, so a model is probed once per setting.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from localllm import paths
from localllm.state_file import unless_broken

from ..planning.plan import Plan
from ..planning.probes import Buffers, DryRun
from .probing import ProbeFailed, ask


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
            with unless_broken(cache, "a cached dry run"):
                found = json.loads(cache.read_bytes().decode("utf-8"))
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
