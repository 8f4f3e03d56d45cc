"""The catalog: every shipped entry parses, names resolve, and malformed data is refused."""

from __future__ import annotations

import pytest

from localllm.modelstore import catalog
from localllm.modelstore.catalog import CatalogError, parse_catalog
from localllm.modelstore.hub import HubFileRef, HubQuantRef, WheelRef, parse_reference
from localllm.modelstore.names import parse_name
from localllm.modelstore.store import DRAFT_LAYER, PROJECTOR_LAYER


def test_shipped_catalog_has_the_promised_names():
    names = {str(name) for name in catalog.load_catalog()}
    for wanted in ("smollm2:latest", "27b-q3:latest", "27b-q4:latest", "gemma3-27b:q3",
                   "gemma3-27b:q4", "gemma3-270m:latest", "qwen3-8b:latest",
                   "llama3.3-70b:latest", "qwen3-30b-a3b:latest"):
        assert wanted in names


def test_every_source_is_a_valid_reference():
    for entry in catalog.entries():
        reference = parse_reference(entry.source)
        assert isinstance(reference, (WheelRef, HubQuantRef, HubFileRef)), entry.name
        assert entry.size > 0


def test_default_model_comes_from_the_wheel_with_a_pinned_hash():
    entry = catalog.lookup("smollm2")
    assert entry is not None
    assert entry.source == "wheel:smollm2"
    assert entry.sha256 == catalog.WHEEL_SOURCES["smollm2"].sha256
    assert entry.size == catalog.WHEEL_SOURCES["smollm2"].size


def test_aliases_and_companions():
    assert catalog.lookup("gemma3-27b") is catalog.lookup("gemma3-27b:q4")
    gemma = catalog.lookup("gemma3-27b:q4")
    kinds = {c.media_type: c.reference for c in gemma.companions}
    assert kinds[DRAFT_LAYER] == "gemma3-270m"
    assert kinds[PROJECTOR_LAYER].endswith("mmproj-model-f16.gguf")
    assert catalog.lookup("no-such-model") is None
    assert catalog.lookup("../etc") is None


@pytest.mark.parametrize("text, message", [
    ('[[model]]\nname = "a"\nsource = "wheel:nope"\nsize = 1\n', "unknown wheel source"),
    ('[[model]]\nname = "a"\nsize = 1\n', "missing"),
    ('[[model]]\nname = "a"\nsource = "hf.co/a/b:Q4"\nsize = 1\nsha256 = "xyz"\n', "sha256"),
    ('[[model]]\nname = "a"\nsource = "hf.co/a/b:Q4"\nsize = 1\ncolour = 1\n', "unknown keys"),
    ('[[model]]\nname = "a"\nsource = "hf.co/a/b:Q4"\nsize = 1\ndraft = "b"\n', "not in the"),
    ('[[model]]\nname = "a"\nsource = "hf.co/a/b:Q4"\nsize = 1\n'
     '[[model]]\nname = "b"\naliases = ["a"]\nsource = "hf.co/a/b:Q4"\nsize = 1\n', "twice"),
])
def test_malformed_catalog_is_refused(text, message):
    with pytest.raises(CatalogError, match=message):
        parse_catalog(text)


def test_catalog_names_are_store_names():
    for name, entry in catalog.load_catalog().items():
        assert parse_name(str(name)) == name
        assert name in entry.names
