"""The content-addressed store: import, list, copy, remove, and refusing bad input."""

from __future__ import annotations

import os

import pytest

from localllm.modelstore.names import BadModelName, parse_name
from localllm.modelstore.store import ModelNotFound, StoreError, sha256_file


def snapshot(root):
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*")
                  if p.is_file())


def test_import_names_a_content_addressed_blob(store, smollm2_gguf):
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    assert str(entry.name) == "smollm2:latest"
    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)
    assert entry.model_path.name == "sha256-" + entry.digest.split(":")[1]
    assert entry.model_path.stat().st_size == smollm2_gguf.stat().st_size
    # Same filesystem: hard-linked, not copied.
    assert os.path.samefile(entry.model_path, smollm2_gguf) or entry.model_path.stat().st_nlink >= 1
    assert entry.details == {"format": "gguf", "family": "llama", "families": ["llama"],
                             "parameter_size": "135M", "quantization_level": "Q4_1"}
    assert [str(e.name) for e in store.list()] == ["smollm2:latest"]


def test_copy_shares_the_blob_and_rm_keeps_it_until_unused(store, smollm2_gguf):
    store.import_gguf(smollm2_gguf, "smollm2")
    copy = store.copy("smollm2", "mine:v1")
    assert copy.digest == store.get("smollm2").digest
    store.remove("smollm2")
    assert copy.model_path.exists(), "the copy still needs the blob"
    assert [str(e.name) for e in store.list()] == ["mine:v1"]
    store.remove("mine:v1")
    assert not copy.model_path.exists()
    assert store.list() == []
    with pytest.raises(ModelNotFound):
        store.get("mine:v1")


def test_a_file_that_is_not_gguf_is_refused_and_the_store_is_unchanged(store, smollm2_gguf,
                                                                      tmp_path):
    store.import_gguf(smollm2_gguf, "smollm2")
    before = snapshot(store.root)
    bogus = tmp_path / "notes.gguf"
    bogus.write_bytes(b"this is not a model\n" * 100)
    with pytest.raises(StoreError, match="not a GGUF"):
        store.import_gguf(bogus, "bogus")
    assert snapshot(store.root) == before


def test_a_truncated_gguf_is_refused_and_the_store_is_unchanged(store, smollm2_gguf, tmp_path):
    store.import_gguf(smollm2_gguf, "smollm2")
    before = snapshot(store.root)
    cut = tmp_path / "cut.gguf"
    with smollm2_gguf.open("rb") as src:
        cut.write_bytes(src.read(smollm2_gguf.stat().st_size // 2))
    with pytest.raises(StoreError, match="truncated"):
        store.import_gguf(cut, "cut")
    header_only = tmp_path / "header.gguf"
    with smollm2_gguf.open("rb") as src:
        header_only.write_bytes(src.read(1000))
    with pytest.raises(StoreError, match="truncated"):
        store.import_gguf(header_only, "cut")
    assert snapshot(store.root) == before


@pytest.mark.parametrize("name", ["../escape", "a/../../b", "..", "x/./y", "/abs", "a b",
                                  "name:../tag", "", "a:", "ok/" + "/".join(["p"] * 5)])
def test_names_cannot_escape_the_store(store, name):
    with pytest.raises(BadModelName):
        parse_name(name)
    with pytest.raises(BadModelName):
        store.get(name)


def test_names_with_namespaces_and_tags():
    assert str(parse_name("hf.co/Owner/Repo:Q4_K_M")) == "hf.co/owner/repo:Q4_K_M"
    assert str(parse_name("smollm2")) == "smollm2:latest"
    assert parse_name("gemma3-27b:q3").tag == "q3"


def test_a_damaged_manifest_does_not_hide_the_other_models(store, smollm2_gguf, gemma_gguf):
    store.import_gguf(smollm2_gguf, "smollm2")
    store.import_gguf(gemma_gguf, "gemma")
    (store.manifests / "gemma" / "latest").write_text("{not json")
    assert [str(e.name) for e in store.list()] == ["smollm2:latest"]
    with pytest.raises(StoreError, match="damaged"):
        store.get("gemma")


def test_the_daemon_reads_a_manifest_again_only_when_it_changed(store, smollm2_gguf,
                                                                gemma_gguf):
    """The daemon keeps the entries requests name (daemon/api/common.py): the same object while
    the manifest stays, a fresh one after a copy over it or an import under its name (as the
    CLI writes the store behind the daemon's back), and a 404 once it is removed."""
    from aiohttp import web

    from localllm.daemon.api.common import KNOWN, known_entry
    from localllm.daemon.state import STORE

    app = web.Application()
    app[STORE], app[KNOWN] = store, {}
    first = store.import_gguf(smollm2_gguf, "m")
    store.import_gguf(gemma_gguf, "g")
    seen = known_entry(app, "m")
    assert seen.digest == first.digest and known_entry(app, "m") is seen
    assert known_entry(app, "m:latest").digest == first.digest  # another spelling, read once
    store.copy("g", "m")
    assert known_entry(app, "m").digest == store.get("g").digest
    store.import_gguf(smollm2_gguf, "m")
    assert known_entry(app, "m").digest == first.digest
    store.remove("m")
    with pytest.raises(ModelNotFound):
        known_entry(app, "m")
    with pytest.raises(BadModelName):
        known_entry(app, "../m")
