"""A vision model's projector in the plan (localllm/planner/vision.py), with the tuner's real
search on card profiles and the full-size synthetic Gemma 3 projector's header."""

from __future__ import annotations

import pytest
from scripts import synth_gguf
from scripts import synth_vision

from localllm.modelstore.projector import projector_info
from localllm.modelstore.shape import read_shape
from localllm.planner.card import GIB, load_card
from localllm.planner.search import Request
from localllm.planner.tuner import tune
from localllm.planner.vision import plan_with_projector, projector_cost


@pytest.fixture(scope="module")
def full_projector(tmp_path_factory):
    path = tmp_path_factory.mktemp("proj") / "mmproj.gguf"
    return projector_info(synth_vision.write_projector(path, synth_vision.PROJECTORS["gemma3-27b"],
                                                     fill="sparse"))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    d = tmp_path_factory.mktemp("shapes")
    return {name: read_shape(synth_gguf.write_gguf(d / f"{name}.gguf", synth_gguf.SHAPES[name]))
            for name in ("gemma3-27b", "llama-8b")}


def test_the_full_projector_header_has_gemma3s_cost(full_projector):
    assert full_projector.projector_type == "gemma3"
    assert full_projector.tokens_per_image == 256
    assert 700 << 20 < full_projector.weight_bytes < 900 << 20  # SigLIP-400M in f16


def test_projector_room_is_kept_on_a_card_with_room(shapes, full_projector):
    card = load_card("rtx4090")
    cost = projector_cost(full_projector)
    plan = plan_with_projector(card, cost, lambda c: tune(shapes["llama-8b"], c, Request()))
    assert plan.projector_on_gpu and plan.predicted_image_s > 0
    assert plan.vram_bytes() <= card.free_vram_bytes
    assert any("vision projector on the GPU" in r for r in plan.reasons)


def test_a_short_card_runs_the_projector_on_the_cpu_and_stays_in_budget(shapes,
                                                                         full_projector):
    card = load_card("h200").with_vram(12)
    cost = projector_cost(full_projector)
    plan = plan_with_projector(card, cost, lambda c: tune(shapes["gemma3-27b"], c, Request()))
    assert plan.vram_bytes() <= 12 * GIB
    # Its 1 GiB on the GPU would push layers of the 27B to the CPU: it runs there instead.
    assert not plan.projector_on_gpu
    assert any("vision projector on the CPU" in r and "layers" in r for r in plan.reasons)
    assert plan.predicted_image_s > 0
    cpu = next(m for m in plan.memory if m.device == "CPU")
    assert cpu.weights >= cost.weights
