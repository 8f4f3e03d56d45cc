"""`tune --card C` plans for the whole box the profile describes (GPU, RAM, cores, disk), `--ram`
and `--cores` change it, and `tune CATALOG_NAME` plans a model before it is pulled, from its
header read by range requests from a local hub (issue 38). The repo holds sparse synthetic
files of a 27B dense shape: real headers and sizes, no weights on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_pull_quant import dense_files, serve  # noqa: F401 (a fixture)

CATALOG_REPO = "unsloth/Qwen3.6-27B-MTP-GGUF"  # 27b-q3's source: hf.co/...:UD-Q3_K_XL
MiB = 1 << 20


@pytest.fixture
def env(home, hub, dense_files, monkeypatch) -> dict:  # noqa: F811
    monkeypatch.delenv("HF_TOKEN", raising=False)
    serve(hub, CATALOG_REPO, {"Qwen3.6-27B-UD-Q3_K_XL.gguf": dense_files["Dense-27B-Q3_K_M.gguf"],
                              "Qwen3.6-27B-Q4_K_M.gguf": dense_files["Dense-27B-Q4_K_M.gguf"]})
    return {**os.environ, "LOCALLLM_HF_ENDPOINT": hub.url}


def localllm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def tune_json(*args: str, env: dict) -> dict:
    result = localllm("tune", *args, "--json", env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_catalog_model_is_planned_from_its_header_before_any_download(env, hub, store):
    result = localllm("tune", "27b-q3", "--card", "rtx3060-12g", env=env)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("27b-q3:latest: ")
    assert ("on: NVIDIA GeForce RTX 3060 12GB 12.0 GiB; host 32.0 GiB RAM, 8 cores, disk 1.5 "
            "GB/s (card profile rtx3060-12g)") in out
    # The hub answers: its header, not the catalog's derived estimate (test_offline_fit.py).
    assert f"read from the hub: the header of hf.co/{CATALOG_REPO}:UD-Q3_K_XL" in out
    assert "nothing downloaded, no profile saved" in out and "saved profile" not in out
    assert store.list() == []
    assert hub.served_bytes < 2 * 16 * MiB  # a header, never the 13 GiB file
    assert all(r and r.startswith("bytes=") for r in hub.cdn_requests)
    profiles = os.path.join(env["XDG_CONFIG_HOME"], "localllm", "profiles")
    assert not os.path.isdir(profiles) or not os.listdir(profiles)


def test_the_box_is_the_profiles_and_ram_and_cores_change_it(env):
    box = tune_json("27b-q4", "--card", "rtx3060-12g", env=env)
    assert (box["card"]["ram_bytes"], box["card"]["cores"]) == (32 << 30, 8)
    assert box["card"]["disk_read_gbs"] == 1.5 and box["card"]["source"] == "profile"
    laptop = tune_json("27b-q4", "--card", "rtx3060-12g", "--ram", "4", "--cores", "2", env=env)
    assert (laptop["card"]["ram_bytes"], laptop["card"]["cores"]) == (4 << 30, 2)
    # Q4_K_M (13.9 GiB) does not fit a 12 GiB card whole: its CPU part runs on the box's cores,
    # and with 4 GiB of RAM part of it is read from disk on every token.
    assert laptop["plan"]["n_threads"] == 2 and box["plan"]["n_threads"] == 8
    assert any("read from disk per token" in r for r in laptop["plan"]["reasons"])
    assert not any("read from disk per token" in r for r in box["plan"]["reasons"])
    assert laptop["plan"]["predicted_decode_tps"] < box["plan"]["predicted_decode_tps"]


@pytest.mark.parametrize("args, words", [
    (["27b-q3", "--card", "rtx3060-12g", "--measure"], "is not pulled: --measure"),
    (["27b-q3", "--card", "rtx3060-12g", "--ram", "0"], "--ram must be a positive"),
    (["gemma3-27b:q3", "--card", "rtx3060-12g"], "mradermacher"),  # a repo the hub lacks
])
def test_errors_are_one_line(env, store, args, words):
    result = localllm("tune", *args, env=env)
    assert result.returncode == 1, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and words in lines[0], \
        result.stderr
    assert store.list() == []
