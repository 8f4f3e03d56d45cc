"""Direct references: parsing, the store name they get, split siblings, quant lookup (pure)."""

from __future__ import annotations

import pytest

from localllm.modelstore.download import (
    PullError, RemoteFile, RemoteNotFound, http_error, plan_parts, sha256_from_headers,
    DownloadOptions,
)
from localllm.modelstore.hub import (
    HubFileRef, HubQuantRef, UrlRef, WheelRef, parse_reference, pick_quant_files,
    split_siblings, store_name,
)


@pytest.mark.parametrize("text, expected, name", [
    ("hf.co/bartowski/Qwen_Qwen3.6-27B-GGUF:Q3_K_M",
     HubQuantRef("bartowski/Qwen_Qwen3.6-27B-GGUF", "Q3_K_M"),
     "hf.co/bartowski/qwen_qwen3.6-27b-gguf:Q3_K_M"),
    ("huggingface.co/unsloth/Qwen3.6-27B-GGUF", HubQuantRef("unsloth/Qwen3.6-27B-GGUF", None),
     "hf.co/unsloth/qwen3.6-27b-gguf:latest"),
    ("hf.co/ggml-org/gemma-3-27b-it-GGUF/gemma-3-27b-it-Q4_K_M.gguf",
     HubFileRef("ggml-org/gemma-3-27b-it-GGUF", "gemma-3-27b-it-Q4_K_M.gguf"),
     "hf.co/ggml-org/gemma-3-27b-it-gguf:gemma-3-27b-it-Q4_K_M"),
    ("hf.co/o/r/Q4_K_M/big-Q4_K_M-00002-of-00003.gguf",
     HubFileRef("o/r", "Q4_K_M/big-Q4_K_M-00002-of-00003.gguf"), "hf.co/o/r:big-Q4_K_M"),
    ("https://huggingface.co/o/r", HubQuantRef("o/r", None), "hf.co/o/r:latest"),
    ("https://example.com:8443/models/My Model.gguf",
     UrlRef("https://example.com:8443/models/My Model.gguf"), "example.com/my-model:latest"),
])
def test_references_and_their_store_names(text, expected, name):
    reference = parse_reference(text)
    assert reference == expected
    assert str(store_name(reference)) == name


def test_plain_names_are_not_references():
    assert parse_reference("27b-q3") is None
    assert parse_reference("gemma3-27b:q4") is None
    assert parse_reference("wheel:smollm2") == WheelRef("smollm2")


@pytest.mark.parametrize("text", [
    "hf.co/onlyowner", "hf.co/o/r/notes.txt", "hf.co/o/r/../x.gguf", "https://example.com/x.bin",
    "hf.co/o/r:Q4:K", "hf.co/../r:Q4",
])
def test_malformed_references(text):
    with pytest.raises(PullError):
        parse_reference(text)


def test_split_siblings():
    assert split_siblings("a/m-Q4-00002-of-00003.gguf") == [
        "a/m-Q4-00001-of-00003.gguf", "a/m-Q4-00002-of-00003.gguf", "a/m-Q4-00003-of-00003.gguf"]
    assert split_siblings("m-Q4_K_M.gguf") is None


def files(*names: str) -> list[RemoteFile]:
    return [RemoteFile(f"http://hub/{n}", n, 1, None) for n in names]


def test_quant_lookup_prefers_the_plain_file_and_groups_splits():
    listing = files("README.md", "m-Q4_K_M.gguf", "m-UD-Q4_K_XL.gguf", "mmproj-F16.gguf",
                    "Q8_0/m-Q8_0-00002-of-00002.gguf", "Q8_0/m-Q8_0-00001-of-00002.gguf")
    assert [f.filename for f in pick_quant_files(listing, None, "o/r")] == ["m-Q4_K_M.gguf"]
    assert [f.filename for f in pick_quant_files(listing, "q4_k_xl", "o/r")] == [
        "m-UD-Q4_K_XL.gguf"]
    assert [f.filename for f in pick_quant_files(listing, "Q8_0", "o/r")] == [
        "Q8_0/m-Q8_0-00001-of-00002.gguf", "Q8_0/m-Q8_0-00002-of-00002.gguf"]
    with pytest.raises(RemoteNotFound, match="available: .*Q4_K_M.*Q8_0"):
        pick_quant_files(listing, "IQ2_XXS", "o/r")
    # One GGUF and no quant asked for: that one, whatever it is called.
    assert pick_quant_files(files("only.Q5_1.gguf"), None, "o/r")[0].filename == "only.Q5_1.gguf"


def test_hash_headers_and_http_errors():
    sha = "ab" * 32
    assert sha256_from_headers({"X-Linked-Etag": f'"{sha}"'}) == sha
    assert sha256_from_headers({"ETag": f'W/"{sha.upper()}"'}) == sha
    assert sha256_from_headers({"ETag": '"' + "a" * 40 + '"'}) is None  # a git sha1, not LFS
    assert "HF_TOKEN" in str(http_error(401, "x", False))
    assert "refused the token" in str(http_error(403, "x", True))
    assert http_error(404, "x", False).status == 404


def test_parts_cover_the_file_exactly():
    options = DownloadOptions(connections=4, min_part_bytes=10)
    parts = plan_parts(1001, options)
    assert parts[0].start == 0 and parts[-1].end == 1001 and len(parts) == 4
    assert all(a.end == b.start for a, b in zip(parts, parts[1:], strict=False))
    assert len(plan_parts(15, options)) == 1 and plan_parts(None, options)[0].end is None
