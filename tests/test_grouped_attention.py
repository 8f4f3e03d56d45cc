"""Patch 0007's grouped decode kernel is the runner's choice by head size (engine/model.py):
off (LOCALLLM_FA_VEC_GQA=0) for heads wider than 128, where it ran slower on an H100, left to
the engine for narrower ones, and never overriding what the environment says. Real llama.cpp
reading the heads of two real models."""

from __future__ import annotations

import os

import llama_cpp
import pytest

from localllm.engine.model import GROUPED_ATTENTION, choose_grouped_attention, head_size


@pytest.fixture
def loaded(smollm2_gguf, gemma_gguf):
    params = llama_cpp.llama_model_default_params()
    models = {name: llama_cpp.llama_model_load_from_file(str(path).encode(), params)
              for name, path in (("smollm2", smollm2_gguf), ("gemma", gemma_gguf))}
    assert all(models.values())
    yield models
    for model in models.values():
        llama_cpp.llama_model_free(model)


def test_heads_wider_than_128_leave_the_grouped_kernel_off(loaded, monkeypatch):
    assert head_size(loaded["smollm2"]) == 64 and head_size(loaded["gemma"]) == 256
    monkeypatch.delenv(GROUPED_ATTENTION, raising=False)
    choose_grouped_attention(loaded["smollm2"])
    assert GROUPED_ATTENTION not in os.environ  # the engine's own rule
    choose_grouped_attention(loaded["gemma"])
    assert os.environ[GROUPED_ATTENTION] == "0"


def test_the_environment_has_the_last_word(loaded, monkeypatch):
    monkeypatch.setenv(GROUPED_ATTENTION, "1")
    choose_grouped_attention(loaded["gemma"])
    assert os.environ[GROUPED_ATTENTION] == "1"
