"""What `rm` deletes, and what the daemon's start sweeps: a delete removes only the layers of
its manifest that no other names; unreferenced blobs and cut staging files go at startup, past
an age, and a pull's resumable download stays."""

from __future__ import annotations

import hashlib
import json
import os
import time
import urllib.request

from gguf_edit import with_metadata

from localllm.modelstore.sweep import BLOB_AGE, STAGING_AGE, sweep_store


def _post(url: str, data: bytes, content_type: str = "application/json") -> tuple[int, str]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_rm_keeps_an_upload_that_its_create_has_not_used_yet(fresh_daemon, smollm2_gguf,
                                                             tmp_path):
    upload = with_metadata(smollm2_gguf, tmp_path / "upload.gguf", {"general.name": "upload"})
    digest = "sha256:" + hashlib.sha256(upload.read_bytes()).hexdigest()
    code, text = _post(f"{fresh_daemon.url}/api/blobs/{digest}", upload.read_bytes(),
                       "application/octet-stream")
    assert code == 201, text
    body = json.dumps({"source": "smollm2", "destination": "spare"}).encode()
    assert _post(f"{fresh_daemon.url}/api/copy", body)[0] == 200
    req = urllib.request.Request(f"{fresh_daemon.url}/api/delete", method="DELETE",
                                 data=json.dumps({"model": "spare"}).encode())
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
    code, text = _post(f"{fresh_daemon.url}/api/create", json.dumps(
        {"model": "uploaded", "files": {"upload.gguf": digest}, "stream": False}).encode())
    assert code == 200, text
    assert "uploaded:latest" in {m["name"] for m in fresh_daemon.get("/api/tags")["models"]}


def test_rm_removes_its_own_blob_and_keeps_a_shared_one(store, smollm2_gguf, gemma_gguf):
    store.import_gguf(smollm2_gguf, "a")
    store.copy("a", "b")
    gemma = store.import_gguf(gemma_gguf, "g")
    store.remove("g")
    assert not gemma.model_path.exists()
    store.remove("a")
    assert store.get("b").model_path.exists()


def test_startup_sweep_removes_old_unused_blobs_and_cut_staging_files_only(store,
                                                                           smollm2_gguf):
    kept = store.import_gguf(smollm2_gguf, "kept")
    orphan = store.blobs / f"sha256-{'ab' * 32}"
    orphan.write_bytes(b"an upload nobody created from")
    staged = store.staging_file("upload-")
    staged.write_bytes(b"x" * 4096)
    resumable = [store.tmp / "download-k.partial", store.tmp / "download-k.json",
                 store.tmp / "download-k.lock"]
    for path in resumable:
        path.write_bytes(b"{}")

    young = sweep_store(store, now=time.time())
    assert young.blobs == [] and young.staging == []
    assert orphan.exists() and staged.exists()

    later = time.time() + max(BLOB_AGE, STAGING_AGE) + 60
    swept = sweep_store(store, now=later)
    assert swept.blobs == [f"sha256:{'ab' * 32}"]
    assert swept.staging == [staged.name]
    assert not orphan.exists() and not staged.exists()
    assert kept.model_path.exists() and all(p.exists() for p in resumable)
    assert swept.freed == len(b"an upload nobody created from") + 4096


def test_a_staging_file_past_its_age_goes_before_an_unused_blob_does(store):
    store.ensure_dirs()
    orphan = store.blobs / f"sha256-{'cd' * 32}"
    orphan.write_bytes(b"upload")
    staged = store.staging_file("import-")
    swept = sweep_store(store, now=time.time() + STAGING_AGE + 60)
    assert swept.staging == [staged.name] and swept.blobs == []
    assert orphan.exists()
    assert os.listdir(store.tmp) == []
