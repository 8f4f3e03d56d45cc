"""A split GGUF (NAME-0000i-of-0000N.gguf) is pulled whole and stored as one model that
llama.cpp loads: the parts stay separate blobs, linked under the names llama.cpp looks for."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from hub_server import Hub
from localllm.modelstore.download import DownloadOptions
from localllm.modelstore.hub import HubSettings
from localllm.modelstore.pull import SPLIT_LAYER, model_file, pull_model
from localllm.modelstore.store import MODEL_LAYER, sha256_file

PARTS = 3


def write_split(source: Path, prefix: Path, parts: int) -> list[Path]:
    """Re-write a GGUF as `parts` shards with the gguf package (what llama-gguf-split does)."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(prefix.with_suffix(".gguf"), arch,
                             split_max_tensors=-(-len(reader.tensors) // parts))
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype,
                               tensor.data.nbytes, tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data, tensor_endianess=reader.endianess)
    writer.close()
    return [prefix.with_name(f"{prefix.name}-{i:05d}-of-{parts:05d}.gguf")
            for i in range(1, parts + 1)]


@pytest.fixture(scope="module")
def split_files(tmp_path_factory, smollm2_gguf) -> list[Path]:
    return write_split(smollm2_gguf, tmp_path_factory.mktemp("split") / "SmolLM2-Q4_1", PARTS)


async def test_split_model_is_pulled_whole_and_loads(store, split_files, smollm2_gguf):
    with Hub() as hub:
        for path in split_files:
            hub.add("test/Split", f"q4_1/{path.name}", path)
        settings = HubSettings(hub.url)
        options = DownloadOptions(disk_margin_bytes=0, backoff_s=0.01)
        entry = await pull_model(store, "hf.co/test/Split:Q4_1", hub=settings, options=options)
        # Any part's name brings the whole model, and costs nothing now.
        served = hub.served_bytes
        again = await pull_model(store, f"hf.co/test/Split/q4_1/{split_files[1].name}",
                                 hub=settings, options=options)
        assert hub.served_bytes == served

    kinds = [layer.media_type for layer in entry.layers]
    assert kinds == [MODEL_LAYER] + [SPLIT_LAYER] * (PARTS - 1)
    assert [layer.digest for layer in entry.layers] == [
        "sha256:" + sha256_file(p) for p in split_files]
    assert again.layers == entry.layers
    assert entry.details["parameter_size"] == "135M"

    path = model_file(store, entry)
    assert path.name == f"model-00001-of-{PARTS:05d}.gguf"
    assert sha256_file(path.with_name(f"model-00003-of-{PARTS:05d}.gguf")) \
        == sha256_file(split_files[2])

    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=128, verbose=False)
    assert llm("The capital of France is", max_tokens=3)["usage"]["completion_tokens"] > 0
