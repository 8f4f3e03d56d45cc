"""Ollama's library names resolve (`llama3.2`, `qwen3:8b`, `gemma3:27b`, ...), a name that
resolves to nothing gets the nearest names in every command that takes a model, `--dry-run`
never promises what the real command refuses, and no hint suggests a pull that would fail."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from localllm.modelstore import catalog
from localllm.modelstore.hub import HubFileRef, HubQuantRef, parse_reference

OLLAMA_NAMES = ["llama3.2", "llama3.2:1b", "llama3.2:3b", "llama3.1:8b", "llama3", "llama3.3",
                "qwen3", "qwen3:0.6b", "qwen3:4b", "qwen3:8b", "qwen3:14b", "qwen3:30b",
                "qwen3-coder", "gemma3", "gemma3:1b", "gemma3:4b", "gemma3:12b", "gemma3:27b",
                "mistral", "phi4", "deepseek-r1", "deepseek-r1:8b", "gpt-oss", "gpt-oss:20b",
                "qwen2.5", "qwen2.5-coder", "nomic-embed-text"]


@pytest.mark.parametrize("name", OLLAMA_NAMES)
def test_ollamas_library_names_resolve_to_a_hub_repo(name):
    entry = catalog.lookup(name)
    assert entry is not None, name
    assert isinstance(parse_reference(entry.source), HubQuantRef | HubFileRef)


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


@pytest.fixture
def env(fresh_daemon) -> dict:
    return {**fresh_daemon.env, "LOCALLLM_HOST": fresh_daemon.url.removeprefix("http://")}


def test_unknown_names_get_the_nearest_in_every_command(env):
    for args, near in ((["pull", "qwen33"], "qwen3"), (["show", "qwn3"], "qwen3"),
                       (["rm", "lama3.2"], "llama3.2"), (["stop", "gemma33"], "gemma3"),
                       (["cp", "smolm2", "x"], "smollm2"), (["pull", "qwen33", "--dry-run"],
                                                            "qwen3")):
        result = _cli(env, *args)
        assert result.returncode == 1, (args, result.stdout)
        [line] = result.stderr.strip().splitlines()
        assert f"did you mean '{near}'?" in line, (args, line)
    result = _cli(env, "show", "zzzzqqqq")
    assert "did you mean" not in result.stderr and "localllm pull zzzzqqqq" not in result.stderr


def test_dry_run_never_promises_what_the_pull_refuses(env):
    result = _cli(env, "pull", "qwen3", "--dry-run")
    assert result.returncode == 0 and "would pull qwen3-8b" in result.stdout
    assert "hf.co/Qwen/Qwen3-8B-GGUF" in result.stdout
    result = _cli(env, "pull", "nosuchmodelanywhere", "--dry-run")
    assert result.returncode == 1 and "not in the catalog" in result.stderr


def test_a_stored_names_hint_pulls_exactly_that_name(env):
    result = _cli(env, "show", "qwen3:8b")
    assert result.returncode == 1 and "`localllm pull qwen3:8b`" in result.stderr


def test_pull_llama32_through_a_recorded_hub_listing(env, hub, smollm2_gguf):
    """`pull llama3.2` fetches the Q4_K_M file of its hub repo (served locally) and stores it
    under the name Ollama users type."""
    hub.add("bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
            smollm2_gguf)
    hub.add("bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q8_0.gguf",
            smollm2_gguf)
    result = _cli({**env, "LOCALLLM_HF_ENDPOINT": hub.url}, "pull", "llama3.2")
    assert result.returncode == 0, result.stderr
    listed = _cli(env, "list")
    assert "llama3.2:latest" in listed.stdout
    assert os.path.exists(smollm2_gguf)
