"""A tiny GGUF cannot make the daemon allocate without bound, and a header's odd numbers are a
400 that names the field (issue 68, items 3 and 6): real files through a real daemon's
/api/import and the real `localllm import`."""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request

import pytest

_U32, _I32, _STR, _ARR, _U64 = 4, 5, 8, 9, 10


def _text(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _text(key) + struct.pack("<I", vtype) + payload


def _gguf(*kvs: bytes, n_tensors: int = 0, pad: int = 64) -> bytes:
    base = [_kv("general.architecture", _STR, _text("llama"))]
    return (b"GGUF" + struct.pack("<IQQ", 3, n_tensors, len(base) + len(kvs))
            + b"".join(base) + b"".join(kvs) + b"\0" * pad)


def _deep(depth: int) -> bytes:
    inner = struct.pack("<IQ", _U32, 1) + struct.pack("<I", 7)
    for _ in range(depth - 1):
        inner = struct.pack("<IQ", _ARR, 1) + inner
    return inner


HOSTILE = {
    "two million blocks": (_gguf(_kv("llama.block_count", _U32, struct.pack("<I", 2_000_000))),
                           "llama.block_count"),
    "a negative block count": (_gguf(_kv("llama.block_count", _I32, struct.pack("<i", -1))),
                               "llama.block_count"),
    "a tensor count the file cannot hold": (_gguf(n_tensors=500_000), "tensor count"),
    "a string of a terabyte": (_gguf(_text("general.name") + struct.pack("<IQ", _STR, 1 << 40)),
                               "general.name"),
    "an array of a terabyte": (_gguf(_kv("llama.rope.freqs", _ARR,
                                         struct.pack("<IQ", _U32, 1 << 40))),
                               "llama.rope.freqs"),
    "context length nested 5000 deep": (_gguf(_kv("llama.context_length", _ARR, _deep(5000))),
                                        "llama.context_length"),
    "context length as text": (_gguf(_kv("llama.context_length", _STR, _text("lots"))),
                               "llama.context_length"),
    "context length as an array": (_gguf(_kv("llama.context_length", _ARR, _deep(1))),
                                   "llama.context_length"),
    "alignment 0": (_gguf(_kv("general.alignment", _U32, struct.pack("<I", 0))),
                    "general.alignment"),
    "alignment as text": (_gguf(_kv("general.alignment", _STR, _text("32"))),
                          "general.alignment"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_header_is_a_400_naming_its_field(daemon, tmp_path, case):
    data, field = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    request = urllib.request.Request(
        f"{daemon.url}/api/import", method="POST", headers={"Content-Type": "application/json"},
        data=json.dumps({"model": "hostile", "path": str(path)}).encode())
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400
    assert field in json.loads(caught.value.read())["error"]
    assert "hostile:latest" not in [m["name"] for m in daemon.get("/api/tags")["models"]]


@pytest.mark.parametrize("case", ["two million blocks", "context length nested 5000 deep"])
def test_the_cli_refuses_a_hostile_header_in_one_line(daemon, tmp_path, case):
    data, field = HOSTILE[case]
    path = tmp_path / "hostile.gguf"
    path.write_bytes(data)
    result = daemon.cli("import", str(path), "--name", "hostile")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0], result.stderr


def test_a_header_within_the_bounds_still_imports(store, tmp_path):
    """The bounds refuse nothing real: a header with counts, a kept array and a short nested
    one reads as before."""
    from localllm.modelstore.gguf_header import read_header

    path = tmp_path / "fine.gguf"
    path.write_bytes(_gguf(_kv("llama.block_count", _U32, struct.pack("<I", 30)),
                           _kv("llama.attention.head_count", _ARR,
                               struct.pack("<IQ", _U32, 2) + struct.pack("<II", 8, 4)),
                           _kv("general.nested", _ARR, _deep(3)),
                           _kv("general.alignment", _U32, struct.pack("<I", 64))))
    md = read_header(path).metadata
    assert md["llama.block_count"] == 30 and md["llama.attention.head_count"] == [8, 4]
    assert md["general.nested"] == [[[7]]]
