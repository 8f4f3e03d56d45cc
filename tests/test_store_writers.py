"""Two writers cannot tear the store, and a damaged manifest loses no weights and stops
nothing (issue 68, item 2): against a real daemon, its CLI and the store's files."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import import_models

from localllm.modelstore.store import ModelStore
from localllm.modelstore.sweep import sweep_store


def _call(url: str, method: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _store(env: dict) -> ModelStore:
    return ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")


def test_concurrent_creates_and_copies_to_one_name_all_answer_and_leave_a_whole_manifest(
        fresh_daemon):
    url = fresh_daemon.url
    calls = []
    for i in range(48):
        if i % 2:
            calls.append((f"{url}/api/copy", "POST", {"source": "smollm2",
                                                      "destination": "same"}))
        else:
            calls.append((f"{url}/api/create", "POST", {"model": "same", "from": "smollm2",
                                                        "system": f"writer {i}",
                                                        "stream": False}))
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda c: _call(*c), calls))
    failed = [(status, text[:200]) for status, text in answers if status != 200]
    assert failed == []
    tags = fresh_daemon.get("/api/tags")
    assert "same:latest" in [m["name"] for m in tags["models"]]
    assert "damaged" not in tags
    folder = _store(fresh_daemon.env).manifests / "same"
    assert [p.name for p in folder.iterdir()] == ["latest"]  # no writer's temporary file left
    json.loads((folder / "latest").read_text())


def _shared_blob(store: ModelStore) -> Path:
    return store.get("smollm2").model_path


@pytest.mark.errors_expected
def test_a_damaged_manifest_keeps_the_blobs_it_names_through_rm_and_the_sweep(
        tmp_path, smollm2_gguf):
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path / "home")
    import_models(env, {"smollm2": smollm2_gguf})
    store = _store(env)
    store.copy("smollm2", "other")
    blob = _shared_blob(store)
    manifest = store.manifests / "other" / "latest"
    manifest.write_text(manifest.read_text()[:300])  # cut short: no longer JSON
    d = start_daemon(env)
    try:
        assert _call(f"{d.url}/api/delete", "DELETE", {"model": "smollm2"})[0] == 200
        assert blob.is_file()  # the damaged manifest still names it
        tags = d.get("/api/tags")
        assert tags["models"] == []
        assert [bad["name"] for bad in tags["damaged"]] == ["other:latest"]
        swept = sweep_store(store, now=time.time() + 7 * 24 * 3600)
        assert swept.blobs == [] and blob.is_file()
        listed = d.cli("list")
        assert listed.returncode == 0 and "other:latest: manifest damaged" in listed.stdout
        removed = d.cli("rm", "other")  # its own error says to remove it so: that works
        assert removed.returncode == 0, removed.stderr
        assert not manifest.exists() and not blob.exists()
        assert "damaged" not in d.get("/api/tags")
    finally:
        d.stop()


@pytest.mark.errors_expected
def test_a_deeply_nested_manifest_neither_stops_the_daemon_nor_500s_the_listings(
        tmp_path, smollm2_gguf):
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path / "home")
    import_models(env, {"smollm2": smollm2_gguf})
    store = _store(env)
    deep = store.manifests / "deep"
    deep.mkdir(mode=0o700)
    (deep / "latest").write_text("[" * 200_000)
    d = start_daemon(env)  # refused to start: the sweep's listing raised RecursionError
    try:
        tags = d.get("/api/tags")
        assert [m["name"] for m in tags["models"]] == ["smollm2:latest"]
        assert tags["damaged"][0]["name"] == "deep:latest"
        assert "nested" in tags["damaged"][0]["error"]
        assert [m["id"] for m in d.get("/v1/models")["data"]] == ["smollm2:latest"]
        status, text = _call(f"{d.url}/api/show", "POST", {"model": "deep"})
        assert status == 409 and "localllm rm deep" in text
        removed = d.cli("rm", "deep")
        assert removed.returncode == 0, removed.stderr
        assert "damaged" not in d.get("/api/tags")
        assert _shared_blob(store).is_file()
    finally:
        d.stop()


def test_a_manifest_that_cannot_be_read_whole_keeps_every_blob(store, smollm2_gguf,
                                                                monkeypatch):
    """A damaged manifest whose bytes cannot all be read may name any blob: rm keeps them all."""
    from localllm.modelstore import manifest_io

    monkeypatch.setattr(manifest_io, "SCAN_AT_MOST", 4096)
    store.import_gguf(smollm2_gguf, "a")
    blob = store.get("a").model_path
    big = store.manifests / "big"
    big.mkdir(mode=0o700)
    (big / "latest").write_bytes(b"x" * (manifest_io.SCAN_AT_MOST + 1))
    assert not store.references().complete
    store.remove("a")
    assert blob.is_file()
    store.remove("big")
    assert store.references().complete
