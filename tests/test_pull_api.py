"""POST /api/pull on the real daemon app: Ollama's progress stream, stream:false, 4xx errors."""

from __future__ import annotations

import asyncio
import json

import ollama
import pytest

from hub_server import FILE, REPO
from localllm.config import Config
from localllm.daemon.server import create_app
from localllm.modelstore.store import sha256_file



@pytest.fixture
def app(store, hub, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return create_app(Config(hf_endpoint=hub.url), store)


async def test_stream_of_progress_objects(aiohttp_client, app, store, smollm2_gguf):
    client = await aiohttp_client(app)
    response = await client.post("/api/pull", json={"model": f"hf.co/{REPO}:Q4_1"})
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("application/x-ndjson")
    events = [json.loads(line) for line in (await response.text()).splitlines()]
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    digest = "sha256:" + sha256_file(smollm2_gguf)
    blob = [e for e in events if e.get("digest") == digest]
    assert blob and blob[-1]["completed"] == blob[-1]["total"] == smollm2_gguf.stat().st_size
    assert store.get(f"hf.co/{REPO}:Q4_1").digest == digest


async def test_stream_false_and_errors(aiohttp_client, app, store, hub):
    client = await aiohttp_client(app)
    response = await client.post("/api/pull", json={"name": f"hf.co/{REPO}/{FILE}",
                                                     "stream": False})
    assert response.status == 200 and await response.json() == {"status": "success"}

    for body, status, words in [
        ({"model": "no-such-model"}, 404, "not in the catalog"),
        ({"model": f"hf.co/{REPO}/missing.gguf"}, 404, "not found"),
        ({"model": f"hf.co/{REPO}:Q8_0", "stream": False}, 404, "available"),
        ({"model": "hf.co/just-owner"}, 400, "expected hf.co/OWNER/REPO"),
        ({}, 400, "model"),
    ]:
        response = await client.post("/api/pull", json=body)
        assert response.status == status, body
        assert words in (await response.json())["error"]
    hub.add("test/Gated", FILE, hub.files[(REPO, FILE)].source)
    hub.gated["test/Gated"] = "secret"
    response = await client.post("/api/pull", json={"model": "hf.co/test/Gated:Q4_1"})
    assert response.status == 400 and "HF_TOKEN" in (await response.json())["error"]
    assert [str(e.name) for e in store.list()] == [f"hf.co/test/smollm2-gguf:{FILE[:-5]}"]


async def test_error_after_the_stream_began_is_a_final_line(aiohttp_client, app, store, hub,
                                                           smollm2_gguf):
    hub.add("test/Bad", FILE, smollm2_gguf, published_sha256="cd" * 32)
    client = await aiohttp_client(app)
    response = await client.post("/api/pull", json={"model": "hf.co/test/Bad:Q4_1"})
    events = [json.loads(line) for line in (await response.text()).splitlines()]
    assert "do not match" in events[-1]["error"]
    assert store.list() == []


async def test_official_ollama_client_yields_progress(aiohttp_server, app, store):
    server = await aiohttp_server(app)
    client = ollama.Client(host=str(server.make_url("")))

    def pull() -> list:
        return list(client.pull(f"hf.co/{REPO}:Q4_1", stream=True))

    progress = await asyncio.to_thread(pull)
    assert progress[0].status == "pulling manifest"
    assert progress[-1].status == "success"
    blobs = [p for p in progress if p.digest]
    assert blobs[-1].completed == blobs[-1].total > 0

    def pull_unknown():
        return list(client.pull("no-such-model", stream=True))

    with pytest.raises(ollama.ResponseError) as raised:
        await asyncio.to_thread(pull_unknown)
    assert raised.value.status_code == 404
    assert store.exists(f"hf.co/{REPO}:Q4_1")


async def test_a_hub_that_does_not_answer_still_gets_pulling_manifest_at_once(
        aiohttp_client, store, monkeypatch):
    import socket

    monkeypatch.delenv("HF_TOKEN", raising=False)
    silent = socket.socket()  # listens, never accepts: connecting works, no answer comes
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        app = create_app(Config(hf_endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}"),
                         store)
        client = await aiohttp_client(app)
        response = await client.post("/api/pull", json={"model": "hf.co/test/silent:Q4_1"})
        assert response.status == 200
        first = await asyncio.wait_for(response.content.readline(), 10)
        assert json.loads(first) == {"status": "pulling manifest"}
        response.close()  # the client goes away: the pull is cancelled
    finally:
        silent.close()
