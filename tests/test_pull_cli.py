"""`localllm pull` as a user runs it: a real subprocess against the local hub."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from hub_server import FILE, REPO
from localllm.modelstore.store import sha256_file

MiB = 1 << 20


@pytest.fixture
def env(home, hub, monkeypatch) -> dict:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return {**os.environ, "LOCALLLM_HF_ENDPOINT": hub.url, "COLUMNS": "160"}


def localllm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_pull_prints_progress_and_lands(store, env, smollm2_gguf):
    result = localllm("pull", f"hf.co/{REPO}:Q4_1", env=env)
    assert result.returncode == 0, result.stderr
    assert "pulled hf.co/test/smollm2-gguf:Q4_1" in result.stdout
    assert "pulling manifest" in result.stderr and "writing manifest" in result.stderr
    assert store.get(f"hf.co/{REPO}:Q4_1").digest == "sha256:" + sha256_file(smollm2_gguf)


def test_pulling_a_stored_model_again_says_so_in_order(store, env):
    assert localllm("pull", f"hf.co/{REPO}:Q4_1", env=env).returncode == 0
    again = localllm("pull", f"hf.co/{REPO}:Q4_1", env=env)
    assert again.returncode == 0, again.stderr
    lines = [line.strip() for line in again.stderr.splitlines() if line.strip()]
    stored = next(i for i, line in enumerate(lines) if "already stored (98 MB)" in line)
    assert lines.index("writing manifest") > stored
    assert "?" not in again.stderr


def test_killed_pull_resumes(store, env, hub, smollm2_gguf):
    digest = sha256_file(smollm2_gguf)
    state = store.root / "tmp" / f"download-{digest}.json"
    hub.hold_after = 30 * MiB
    process = subprocess.Popen([sys.executable, "-m", "localllm.cli", "pull",
                                f"hf.co/{REPO}:Q4_1"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:  # wait until the pull has recorded the 30 MiB it got
            assert time.monotonic() < deadline and process.poll() is None
            try:
                done = sum(p[2] for p in json.loads(state.read_text())["parts"])
            except (OSError, ValueError):
                done = 0
            if done >= 30 * MiB:
                break
            time.sleep(0.02)  # ok-sleep: the poll interval of a deadline loop
    finally:
        process.kill()
        process.wait()
    assert not store.exists(f"hf.co/{REPO}:Q4_1")
    hub.release()
    result = localllm("pull", f"hf.co/{REPO}:Q4_1", env=env)
    assert result.returncode == 0, result.stderr
    assert hub.cdn_requests[-1] == f"bytes={30 * MiB}-{smollm2_gguf.stat().st_size - 1}"
    assert store.get(f"hf.co/{REPO}:Q4_1").digest == f"sha256:{digest}"
    assert not list(store.tmp.iterdir())


@pytest.mark.parametrize("args, words", [
    (["pull", "no-such-model"], "not in the catalog"),
    (["pull", f"hf.co/{REPO}/missing.gguf"], "not found (HTTP 404)"),
    (["pull", "hf.co/test/Gated:Q4_1"], "set HF_TOKEN"),
    (["pull", "https://example.com/notes.txt"], "must point at a .gguf file"),
    (["pull"], "name a model to pull"),
])
def test_errors_are_one_line(store, env, hub, smollm2_gguf, args, words):
    hub.add("test/Gated", FILE, smollm2_gguf)
    hub.gated["test/Gated"] = "secret"
    result = localllm(*args, env=env)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and words in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert store.list() == []


def test_gated_repo_with_token(store, env, hub, smollm2_gguf):
    hub.add("test/Gated", FILE, smollm2_gguf)
    hub.gated["test/Gated"] = "secret"
    result = localllm("pull", "hf.co/test/Gated:Q4_1", env={**env, "HF_TOKEN": "secret"})
    assert result.returncode == 0, result.stderr


def test_list_shows_catalog_sizes_and_fit(env):
    result = localllm("pull", "--list", "--card", "rtx3060-12g", env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    row = next(line for line in lines if line.split()[:1] == ["smollm2"])
    assert "98 MB" in row and "fits on GPU" in row  # decimal units, as `list` and Ollama
    row = next(line for line in lines if line.split()[:1] == ["llama3.3-70b"])
    assert "~42.5 GB" in row and ("partly" in row or "too big" in row)
    assert any(line.split()[:1] == ["27b-q3"] for line in lines)
