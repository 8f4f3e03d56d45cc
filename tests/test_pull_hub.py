"""Pulls from a local hub with Hugging Face's URL layout: verified, resumed, refused cleanly."""

from __future__ import annotations

import asyncio

import pytest

from daemon_process import wait_for_async
from hub_server import FILE, REPO
from localllm.modelstore.download import (
    AuthRequired, DiskTooSmall, DownloadOptions, HashMismatch, NotGGUF, RangeRefused,
    RemoteNotFound,
)
from localllm.modelstore.hub import HubSettings
from localllm.modelstore.pull import ensure_model_async, pull_model
from localllm.modelstore.store import sha256_file

MiB = 1 << 20
# Small parts so the 94 MiB test model comes in several parallel ranges; quick retries.
FAST = DownloadOptions(connections=4, min_part_bytes=8 * MiB, backoff_s=0.01, retries=3,
                       disk_margin_bytes=0)


@pytest.fixture
def settings(hub) -> HubSettings:
    return HubSettings(hub.url)


@pytest.fixture
def kept(store, gemma_gguf):
    """A model already in the store, which no failed pull may touch."""
    store.import_gguf(gemma_gguf, "kept")
    return store


def snapshot(store):
    blobs = sorted(p.name for p in store.blobs.iterdir()) if store.blobs.exists() else []
    return [str(e.name) for e in store.list()], blobs


async def test_pull_by_quant_lands_verified_in_parallel_parts_and_runs(store, hub, settings,
                                                                        smollm2_gguf):
    events = []
    entry = await pull_model(store, f"hf.co/{REPO}:Q4_1", events.append, hub=settings,
                             options=FAST)
    assert str(entry.name) == "hf.co/test/smollm2-gguf:Q4_1"
    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)
    assert sha256_file(entry.model_path) == sha256_file(smollm2_gguf)
    assert len([r for r in hub.cdn_requests if r and r.startswith("bytes=")]) == 4
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest" and statuses[-3:] == [
        "verifying sha256 digest", "writing manifest", "success"]
    blob_events = [e for e in events if "digest" in e]
    assert blob_events[-1]["completed"] == blob_events[-1]["total"] == entry.size
    assert blob_events[-1]["status"] == f"pulling {entry.digest[7:19]}"
    assert not list(store.tmp.iterdir())

    from llama_cpp import Llama

    llm = Llama(str(entry.model_path), n_ctx=128, verbose=False)
    out = llm("The capital of France is", max_tokens=3)
    assert out["usage"]["completion_tokens"] > 0


async def test_second_pull_of_a_stored_blob_costs_nothing(store, hub, settings):
    await pull_model(store, f"hf.co/{REPO}/{FILE}", hub=settings, options=FAST)
    served = hub.served_bytes
    again = await pull_model(store, f"hf.co/{REPO}:Q4_1", hub=settings, options=FAST)
    assert hub.served_bytes == served
    assert {str(e.name) for e in store.list()} == {
        "hf.co/test/smollm2-gguf:SmolLM2-135M-Instruct.Q4_1", str(again.name)}
    assert len(list(store.blobs.iterdir())) == 1
    # Stored: ensure_model answers from the store, no request at all.
    requests = len(hub.cdn_requests)
    assert (await ensure_model_async(store, f"hf.co/{REPO}:Q4_1", hub=settings)).digest \
        == again.digest
    assert len(hub.cdn_requests) == requests


async def test_plain_url_without_published_hash(store, hub, smollm2_gguf):
    url = f"{hub.url}/plain/{FILE}"
    entry = await pull_model(store, url, hub=HubSettings("http://unused.invalid"), options=FAST)
    assert str(entry.name) == f"127.0.0.1/{FILE.removesuffix('.gguf').lower()}:latest"
    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)


async def test_dropped_connections_resume_to_the_right_hash(store, hub, settings, smollm2_gguf):
    hub.drops = [5 * MiB, 3 * MiB, 7 * MiB, 1 * MiB, 2 * MiB]
    entry = await pull_model(store, f"hf.co/{REPO}:Q4_1", hub=settings, options=FAST)
    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)
    assert len(hub.cdn_requests) >= 4 + 5  # every drop was followed by a resumed range
    resumed = [r for r in hub.cdn_requests if r and not r.startswith("bytes=0-")]
    assert resumed
    # Everything was served about once: resumes continued where the drops cut off.
    assert hub.served_bytes == entry.size


async def test_single_stream_resumes_with_a_range(store, hub, settings, smollm2_gguf):
    hub.drops = [10 * MiB, 20 * MiB]
    single = DownloadOptions(connections=1, backoff_s=0.01, disk_margin_bytes=0)
    entry = await pull_model(store, f"hf.co/{REPO}:Q4_1", hub=settings, options=single)
    assert hub.cdn_requests == [None, f"bytes={10 * MiB}-{entry.size - 1}",
                                f"bytes={30 * MiB}-{entry.size - 1}"]
    assert entry.digest == "sha256:" + sha256_file(smollm2_gguf)


async def test_gated_repo_needs_the_token(kept, hub, settings, smollm2_gguf):
    hub.add("test/Gated", FILE, smollm2_gguf)
    hub.gated["test/Gated"] = "secret"
    before = snapshot(kept)
    with pytest.raises(AuthRequired, match="HF_TOKEN"):
        await pull_model(kept, "hf.co/test/Gated:Q4_1", hub=settings, options=FAST)
    with pytest.raises(AuthRequired, match="refused the token"):
        await pull_model(kept, "hf.co/test/Gated:Q4_1", hub=HubSettings(hub.url, "wrong"),
                         options=FAST)
    assert snapshot(kept) == before
    entry = await pull_model(kept, f"hf.co/test/Gated/{FILE}",
                             hub=HubSettings(hub.url, "secret"), options=FAST)
    assert kept.exists(entry.name)


@pytest.mark.parametrize("reference, error, message", [
    (f"hf.co/{REPO}/missing.gguf", RemoteNotFound, "not found"),
    ("hf.co/test/NoSuchRepo:Q4_K_M", RemoteNotFound, "not found"),
    (f"hf.co/{REPO}:Q8_0", RemoteNotFound, "available: Q4_1"),
])
async def test_not_found(kept, hub, settings, reference, error, message):
    before = snapshot(kept)
    with pytest.raises(error, match=message):
        await pull_model(kept, reference, hub=settings, options=FAST)
    assert snapshot(kept) == before


async def test_wrong_bytes_are_discarded(kept, hub, settings, smollm2_gguf):
    hub.add("test/Bad", FILE, smollm2_gguf, published_sha256="ab" * 32)
    before = snapshot(kept)
    with pytest.raises(HashMismatch, match="do not match"):
        await pull_model(kept, "hf.co/test/Bad:Q4_1", hub=settings, options=FAST)
    assert snapshot(kept) == before
    assert not [p for p in kept.tmp.iterdir() if p.suffix == ".partial"]


async def test_range_refused(kept, hub, settings):
    hub.drops = [2 * MiB]
    hub.refuse_ranges = True
    before = snapshot(kept)
    single = DownloadOptions(connections=1, backoff_s=0.01, disk_margin_bytes=0)
    with pytest.raises(RangeRefused, match="416"):
        await pull_model(kept, f"hf.co/{REPO}:Q4_1", hub=settings, options=single)
    assert snapshot(kept) == before
    assert not list(kept.tmp.glob("download-*"))  # the stale partial is gone


async def test_not_gguf(kept, hub, settings, tmp_path):
    text = tmp_path / "notes-Q4_0.gguf"
    text.write_text("this is a README, not a model\n" * 1000)
    hub.add("test/Text", "notes-Q4_0.gguf", text)
    before = snapshot(kept)
    with pytest.raises(NotGGUF, match="not a GGUF"):
        await pull_model(kept, "hf.co/test/Text:Q4_0", hub=settings, options=FAST)
    assert snapshot(kept) == before
    assert not list(kept.tmp.glob("download-*"))


async def test_disk_too_small(kept, hub, settings):
    tiny = DownloadOptions(free_disk=lambda path: 50 * MiB)
    before = snapshot(kept)
    with pytest.raises(DiskTooSmall, match="not enough disk space"):
        await pull_model(kept, f"hf.co/{REPO}:Q4_1", hub=settings, options=tiny)
    assert snapshot(kept) == before
    assert hub.served_bytes == 0


async def poll(condition, seconds: float = 30.0) -> None:
    await wait_for_async(condition, seconds)


async def test_two_concurrent_pulls_download_once(store, hub, settings, smollm2_gguf):
    hub.hold_after = 4 * MiB
    first, second = [], []
    single = DownloadOptions(connections=1, backoff_s=0.01, disk_margin_bytes=0)
    a = asyncio.create_task(pull_model(store, f"hf.co/{REPO}:Q4_1", first.append, hub=settings,
                                       options=single))
    await poll(lambda: hub.holding)
    b = asyncio.create_task(pull_model(store, f"hf.co/{REPO}:Q4_1", second.append,
                                       hub=settings, options=single))
    # The second pull waits on the blob's lock and shows the first one's progress meanwhile.
    await poll(lambda: any(e.get("completed") for e in second))
    hub.release()
    one, two = await asyncio.gather(a, b)
    assert one.digest == two.digest == "sha256:" + sha256_file(smollm2_gguf)
    assert hub.cdn_requests == [None]
    assert hub.served_bytes == one.size
    assert second[-1]["status"] == "success"
