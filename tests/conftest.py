"""Shared fixtures: real test models, an isolated home for localllm, a real daemon."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from scripts import fetch_test_models  # noqa: E402

from localllm.modelstore.store import ModelStore  # noqa: E402


def _test_model(name: str) -> Path:
    # Ours and 0600, as the store links only such files (others are copied: 100-250 MB a
    # daemon fixture).
    path = fetch_test_models.ensure(name)
    path.chmod(0o600)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1: llama architecture with a chat template."""
    return _test_model("SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="session")
def gemma_gguf() -> Path:
    """Gemma 3 270M Q4_K_M: sliding-window layers, no chat template."""
    return _test_model("gemma-3-270m-q4_k_m.gguf")


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


def import_models(env: dict, models: dict[str, Path]) -> None:
    """Import real GGUFs into the store an isolated daemon will use (hard links: no copy)."""
    import os

    from localllm.modelstore.store import ModelStore

    root = Path(env["XDG_DATA_HOME"]) / "localllm" / "models"
    store = ModelStore(root)
    for name, path in models.items():
        store.import_gguf(path, name)
    assert os.path.isdir(root)


@pytest.fixture(scope="session")
def daemon(tmp_path_factory, smollm2_gguf, gemma_gguf):
    """One real daemon for the read-mostly API tests, with smollm2 and gemma3-270m stored."""
    from daemon_process import isolated_env, start_daemon

    # Over TCP, /api/import and FROM read only files under import_dirs (the home by default):
    # let the read-mostly tests import the test models and their own temporary files.
    env = isolated_env(tmp_path_factory.mktemp("daemon"), LOCALLLM_IMPORT_DIRS=",".join(
        [str(smollm2_gguf.parent.resolve()), str(tmp_path_factory.getbasetemp().resolve())]))
    import_models(env, {"smollm2": smollm2_gguf, "gemma3-270m": gemma_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.fixture
def fresh_daemon(tmp_path, smollm2_gguf):
    """A daemon of the test's own, for tests that kill runners or delete models."""
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path / "fresh")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.fixture
def hub(smollm2_gguf):
    """A local Hugging Face-style hub serving SmolLM2 as hub_server.REPO/FILE."""
    from hub_server import FILE, REPO, Hub

    with Hub() as hub:
        hub.add(REPO, FILE, smollm2_gguf)
        yield hub


@pytest.fixture(scope="session")
def agent_daemon(tmp_path_factory, smollm2_gguf):
    """A daemon for the agents' APIs (/v1/messages, /v1/responses): SmolLM2 as published, a
    copy with a tool template and a copy with a thinking template (tests/chat_models.py)."""
    from chat_models import thinking_model, tool_model
    from daemon_process import isolated_env, start_daemon

    root = tmp_path_factory.mktemp("agents")
    env = isolated_env(root / "home")
    import_models(env, {"smollm2": smollm2_gguf,
                        "smollm2-tools": tool_model(smollm2_gguf, root),
                        "smollm2-thinking": thinking_model(smollm2_gguf, root)})
    d = start_daemon(env)
    yield d
    d.stop()


def _log_sizes() -> dict[Path, int]:
    from daemon_process import DAEMON_LOGS

    return {path: path.stat().st_size if path.exists() else 0 for path in DAEMON_LOGS}


@pytest.fixture(autouse=True)
def no_unexpected_error_logs(request):
    """No test makes a daemon log an error unless it says so (marker `errors_expected`): an
    error line nobody caused on purpose is a bug the test happened to walk past."""
    before = _log_sizes()
    yield
    if request.node.get_closest_marker("errors_expected"):
        return
    errors = []
    for path, size in _log_sizes().items():
        if size <= before.get(path, 0):
            continue
        with path.open("rb") as f:
            f.seek(before.get(path, 0))
            added = f.read().decode(errors="replace")
        errors += [line for line in added.splitlines() if "level=error" in line]
    if errors:
        pytest.fail("the daemon logged errors this test did not cause on purpose:\n"
                    + "\n".join(errors[:10]), pytrace=False)

