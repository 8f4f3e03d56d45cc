"""Catalog entries that bring companions: the draft model and vision projector are pulled with
the model and recorded in its manifest, so the runner finds them (ModelEntry.companion)."""

from __future__ import annotations

import pytest

from hub_server import Hub
from localllm.modelstore.download import DownloadOptions
from localllm.modelstore.hub import HubSettings
from localllm.modelstore.pull import ensure_model_async, pull_model
from localllm.modelstore.store import DRAFT_LAYER, PROJECTOR_LAYER, sha256_file

OPTIONS = DownloadOptions(disk_margin_bytes=0, backoff_s=0.01)


@pytest.fixture
def hub(smollm2_gguf, gemma_gguf):
    """The catalog's real repo and file names, served with the small test models."""
    with Hub() as hub:
        hub.add("ggml-org/gemma-3-27b-it-GGUF", "gemma-3-27b-it-Q4_K_M.gguf", smollm2_gguf)
        hub.add("ggml-org/gemma-3-27b-it-GGUF", "mmproj-model-f16.gguf", gemma_gguf)
        hub.add("Qwen/Qwen3-8B-GGUF", "Qwen3-8B-Q4_K_M.gguf", smollm2_gguf)
        hub.add("Qwen/Qwen3-0.6B-GGUF", "Qwen3-0.6B-Q8_0.gguf", gemma_gguf)
        yield hub


async def test_projector_and_stored_draft(store, hub, smollm2_gguf, gemma_gguf):
    draft = store.import_gguf(gemma_gguf, "gemma3-270m")  # already here: not pulled again
    entry = await pull_model(store, "gemma3-27b", hub=HubSettings(hub.url), options=OPTIONS)
    assert str(entry.name) == "gemma3-27b:latest"
    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)
    assert entry.companion(DRAFT_LAYER).digest == draft.digest
    assert entry.companion(PROJECTOR_LAYER).digest == "sha256:" + sha256_file(gemma_gguf)
    assert entry.source.startswith("gemma3-27b:q4 <- hf.co/ggml-org/")
    # The canonical name answers from the store: same layers, no request to the hub.
    requests = len(hub.cdn_requests)
    same = await ensure_model_async(store, "gemma3-27b:q4", hub=HubSettings(hub.url))
    assert same.layers == entry.layers and len(hub.cdn_requests) == requests


async def test_missing_draft_is_pulled_first(store, hub, gemma_gguf):
    events = []
    entry = await pull_model(store, "qwen3-8b", events.append, hub=HubSettings(hub.url),
                             options=OPTIONS)
    draft = store.get("qwen3-0.6b")
    assert draft.digest == "sha256:" + sha256_file(gemma_gguf)
    assert entry.companion(DRAFT_LAYER).digest == draft.digest
    statuses = [e["status"] for e in events]
    assert statuses.count("success") == 1 and statuses[-1] == "success"
    assert statuses.count("pulling manifest") == 1
    assert len({e["digest"] for e in events if "digest" in e}) == 2
