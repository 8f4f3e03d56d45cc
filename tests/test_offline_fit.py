""""Does 27b-q3 fit my card?" answered with no hub (issue 66): `pull NAME --dry-run` and
`tune NAME --card CARD` plan a catalog model from the shape the catalog carries when the hub
cannot be reached, and say so; SmolLM2's catalog shape (read from its file) plans exactly as
its header read from a (local) hub does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hub_server import FILE, REPO

CLOSED = "http://127.0.0.1:9"  # nothing listens there: the connection is refused at once


def localllm(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@pytest.fixture
def offline(home, monkeypatch) -> dict:
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return {**os.environ, "LOCALLLM_HF_ENDPOINT": CLOSED, "COLUMNS": "160"}


def test_pull_dry_run_answers_whether_27b_q3_fits_with_no_hub(offline, store):
    result = localllm("pull", "27b-q3", "--dry-run", "--card", "rtx3060-12g", env=offline)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "would pull 27b-q3:latest <- hf.co/unsloth/Qwen3.6-27B-MTP-GGUF:UD-Q3_K_XL" in out
    [verdict] = [line for line in out.splitlines() if line.startswith("27b-q3: ")]
    # 13.9 GiB on a 12 GiB card: it runs, with part of it in RAM.
    assert "fits in VRAM and RAM of NVIDIA GeForce RTX 3060 12GB" in verdict
    assert "n_gpu_layers=" in verdict and "tok/s" in verdict
    assert "shape from the catalog: derived from Qwen3.6-27B's published config" in out
    assert "the hub could not be reached: cannot reach 127.0.0.1:9" in out
    assert "dry run: nothing downloaded" in out
    assert store.list() == []


def test_a_bigger_card_fits_it_whole(offline):
    result = localllm("pull", "27b-q3", "--dry-run", "--card", "rtx4090", env=offline)
    assert result.returncode == 0, result.stderr
    assert "27b-q3: fits wholly on the GPU of NVIDIA GeForce RTX 4090" in result.stdout


def test_tune_plans_27b_q3_for_a_card_with_no_hub(offline):
    result = localllm("tune", "27b-q3", "--card", "rtx3060-12g", env=offline)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("27b-q3:latest: qwen35, 27B UD-Q3_K_XL, ")
    assert "n_ctx=" in out and "n_gpu_layers=" in out and "predicted: prefill" in out
    assert "shape from the catalog: derived from" in out
    assert "nothing downloaded, no profile saved" in out


def test_quant_auto_plans_the_quants_the_catalog_carries(offline):
    result = localllm("pull", "27b-q3", "--quant", "auto", "--dry-run", "--card", "rtx4090",
                      env=offline)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "27b-q3 (UD-Q3_K_XL)" in out and "27b-q4 (Q4_K_M)" in out
    assert "picked Q4_K_M: fits wholly on the GPU" in out
    assert "the 2 quants of hf.co/unsloth/Qwen3.6-27B-MTP-GGUF it carries shapes for" in out


@pytest.mark.parametrize("args, code, words", [
    # Not in the catalog: the error it always had.
    (["pull", "nosuchmodelanywhere", "--dry-run"], 1, "not in the catalog"),
    # In the catalog with no shape, and no hub: tune cannot plan it...
    (["tune", "qwen3-8b", "--card", "rtx3060-12g"], 1, "cannot reach 127.0.0.1:9"),
    # ...and the dry run says what it would pull, and why it is not planned.
    (["pull", "qwen3-8b", "--dry-run", "--card", "rtx3060-12g"], 0,
     "not planned: the catalog carries no shape for it and the hub could not be reached"),
])
def test_what_has_no_shape_says_so_in_a_line(offline, args, code, words):
    result = localllm(*args, env=offline)
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    if code:
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("Error:") and words in line, line
    else:
        assert words in result.stdout


def _row(out: str, key: str) -> list[str]:
    """The quants table's figures for one file: size, bits/weight, where, decode."""
    [line] = [x for x in out.splitlines() if key in x and "tok/s" in x and ":" not in x]
    return line.replace("*", " ").split()[-6:]


def test_smollm2_plans_the_same_from_the_catalog_as_from_its_header_on_a_hub(home, hub,
                                                                         smollm2_gguf):
    """The catalog's SmolLM2 shape (read from the file it pins, so no hub is asked) against the
    same file's header read by range requests from a local hub."""
    env = {**os.environ, "LOCALLLM_HF_ENDPOINT": hub.url, "COLUMNS": "160"}
    ours = localllm("pull", "smollm2", "--dry-run", "--card", "rtx3060-12g", env=env)
    remote = localllm("pull", f"hf.co/{REPO}", "--dry-run", "--card", "rtx3060-12g", env=env)
    assert ours.returncode == 0 and remote.returncode == 0, (ours.stderr, remote.stderr)
    assert "shape from the catalog: read from the GGUF header of the file it pins" in ours.stdout
    assert "read by range requests" in remote.stdout
    assert _row(ours.stdout, "smollm2") == _row(remote.stdout, FILE)
    # And tune's whole plan: the catalog's shape against the file itself.
    offline = {**env, "LOCALLLM_HF_ENDPOINT": CLOSED}
    plans = [json.loads(localllm("tune", model, "--card", "rtx3060-12g", "--json", "--no-save",
                                 env=offline).stdout)["plan"]
             for model in ("smollm2", str(smollm2_gguf))]
    assert plans[0] == plans[1]
