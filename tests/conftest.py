"""Shared fixtures: real test models, an isolated home for localllm, a real daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import fetch_test_models  # noqa: E402

from localllm.modelstore.store import ModelStore  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1: llama architecture with a chat template."""
    return fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M: sliding-window layers, no chat template."""
    return fetch_test_models.ensure("gemma-3-270m-q4_k_m.gguf")


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """Point every localllm directory (XDG data/config/state/cache/runtime) at a temp dir."""
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_CACHE_HOME",
                "XDG_RUNTIME_DIR"):
        d = tmp_path / var.lower()
        d.mkdir(mode=0o700)
        monkeypatch.setenv(var, str(d))
    for var in ("LOCALLLM_HOST", "LOCALLLM_SOCKET", "LOCALLLM_MODELS", "LOCALLLM_API_KEY",
                "LOCALLLM_KEEP_ALIVE"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.fixture
def store(home) -> ModelStore:
    from localllm.modelstore.store import default_store

    return default_store()
