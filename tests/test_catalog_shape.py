"""The shapes the catalog carries (localllm/modelstore/catalog_shapes.toml): rebuilt without the
file, a shape read from a real header is that file's shape in every field the planner reads,
plans the same as the file, and every entry agrees with the catalog it describes."""

from __future__ import annotations

import dataclasses
import io
import random
from contextlib import redirect_stdout

import pytest

from localllm.modelstore import catalog
from localllm.modelstore.catalog_shape import (
    DERIVED, HEADER, CatalogShapeError, format_blocks, load_shapes, model_shape, parse_blocks,
    parse_shapes,
)
from localllm.modelstore.names import parse_name
from localllm.modelstore.shape import read_shape
from localllm.planner.card import load_card
from localllm.planner.costs import model_costs
from localllm.planner.search import Request
from localllm.planner.tuner import tune

# ModelShape fields no planner reads: where the file is, and what the chat layer takes from it.
NOT_PLANNED = {"path", "tensors", "chat_template", "bos_token_id", "eos_token_id"}


def _shape(name: str):
    return model_shape(load_shapes()[parse_name(name)])


@pytest.mark.parametrize("name, fixture", [("smollm2", "smollm2_gguf"),
                                           ("gemma3-270m", "gemma_gguf")])
def test_a_header_shape_is_the_files_shape(name, fixture, request):
    real = read_shape(request.getfixturevalue(fixture))
    ours = _shape(name)
    for field in dataclasses.fields(real):
        if field.name not in NOT_PLANNED:
            assert getattr(ours, field.name) == getattr(real, field.name), field.name
    # The tensor table in full (the catalog lists it grouped, so the order differs).
    assert sorted(ours.tensors, key=lambda t: t.name) == sorted(real.tensors,
                                                                key=lambda t: t.name)
    assert model_costs(ours) == model_costs(real)  # what the planner prices from


@pytest.mark.parametrize("card", ["rtx3060-12g", "rtx4060"])
def test_smollm2_plans_the_same_from_the_catalog_as_from_its_file(smollm2_gguf, card):
    box = load_card(card)
    for n_ctx in (None, 8192):
        request = Request(n_ctx=n_ctx)
        ours = tune(_shape("smollm2"), box, request)
        real = tune(read_shape(smollm2_gguf), box, request)
        assert ours.to_dict() == real.to_dict()


def test_every_shape_describes_a_catalog_entry_and_agrees_with_it():
    shapes = load_shapes()
    assert {"smollm2", "gemma3-270m", "27b-q3", "27b-q4"} <= {n.base for n in shapes}
    for name, described in shapes.items():
        entry = catalog.lookup(name)
        assert entry is not None and entry.name == name, name
        assert entry.shape is described
        assert described.file_size == entry.size, name
        shape = model_shape(described)
        if described.origin == HEADER:
            assert described.sha256 == entry.sha256, name
        else:
            assert described.origin == DERIVED and described.source
            # Scaled to the published size: the weights are the file, less at most 0.1%.
            assert abs(shape.weight_bytes - entry.size) < entry.size * 1e-3, name
        assert shape.n_layer and shape.embedding_length and shape.n_vocab, name
        assert all(layer.weight_bytes for layer in shape.layers), name


def test_the_27b_hybrid_is_qwen36s_shape():
    """Qwen3.6-27B as the project's reference gives it: 64 blocks (16 attend, 48 Gated
    DeltaNet) and one MTP block, 64 KiB of f16 KV per token, 149.6 MiB of recurrent state."""
    shape = _shape("27b-q3")
    kinds = [layer.kind for layer in shape.layers if not layer.is_nextn]
    assert (shape.n_layer, shape.n_nextn, kinds.count("full")) == (65, 1, 16)
    assert [i for i, k in enumerate(kinds) if k == "full"] == list(range(3, 64, 4))
    assert shape.kv_bytes_per_token(2, 2) == 64 << 10
    assert round(shape.recurrent_state_bytes / (1 << 20), 1) == 149.6
    assert shape.context_length == 262144


@pytest.mark.parametrize("seed", range(20))
def test_block_sets_round_trip(seed):
    rng = random.Random(seed)
    blocks = sorted(rng.sample(range(80), rng.randint(1, 80)))
    text = format_blocks(blocks)
    assert parse_blocks(text) == blocks, text


def test_block_sets_are_short_for_the_patterns_models_have():
    assert format_blocks(list(range(30))) == "0-29"
    assert format_blocks(list(range(3, 64, 4))) == "3-63/4"
    recurrent = [i for i in range(64) if i % 4 != 3]
    assert parse_blocks(format_blocks(recurrent)) == recurrent
    assert len(format_blocks(recurrent).split(",")) <= 3


@pytest.mark.parametrize("text, words", [
    ('["x"]\norigin = "header"\n', "KeyError"),
    ('["smollm2"]\norigin = "guessed"\nfile_size = 1\nn_vocab = 1\ntensors = []\n'
     '["smollm2".metadata]\n', "origin must be"),
    ('["smollm2"]\norigin = "derived"\nfile_size = 1\nn_vocab = 1\n'
     'tensors = ["blk.0-x attn_q.weight Q4_0 32x32"]\n["smollm2".metadata]\n', "bad block set"),
    ('["smollm2"]\norigin = "header"\nfile_size = 1\nn_vocab = 1\ntensors = []\n'
     '["smollm2".metadata]\n', "sha256"),
])
def test_a_malformed_shapes_file_names_the_entry(text, words):
    with pytest.raises(CatalogShapeError, match=words):
        parse_shapes(text)


def test_the_script_prints_the_catalogs_block_for_smollm2(smollm2_gguf):
    """scripts/catalog_shape.py, run on the file, prints what the catalog holds for it."""
    from scripts import catalog_shape

    out = io.StringIO()
    with redirect_stdout(out):
        catalog_shape.main(["smollm2", "--file", str(smollm2_gguf)])
    [printed] = parse_shapes(out.getvalue()).values()
    assert printed == load_shapes()[parse_name("smollm2")]
