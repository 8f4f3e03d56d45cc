"""Copy a real GGUF with some metadata keys replaced or added (a chat template, FIM token ids):
the tensors are copied byte for byte, so the copy runs exactly like the original."""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

from localllm.modelstore.gguf_header import _ARRAY, _SCALARS, _STRING, _Reader

_U32, _STR = 4, 8


def _skip_value(r: _Reader, vtype: int) -> None:
    if vtype in _SCALARS:
        r.f.seek(struct.calcsize(_SCALARS[vtype]), 1)
    elif vtype == _STRING:
        r.skip_strings(1)
    elif vtype == _ARRAY:
        item = r.unpack("<I")
        count = r.unpack("<Q")
        if item == _STRING:
            r.skip_strings(count)
        else:
            r.f.seek(count * struct.calcsize(_SCALARS[item]), 1)


def _encode(key: str, value: str | int) -> bytes:
    name = key.encode()
    out = struct.pack("<Q", len(name)) + name
    if isinstance(value, str):
        data = value.encode()
        return out + struct.pack("<IQ", _STR, len(data)) + data
    return out + struct.pack("<II", _U32, value)


def with_metadata(src: Path, dst: Path, changes: dict[str, str | int]) -> Path:
    with open(src, "rb") as f:
        r = _Reader(f, src)
        assert f.read(4) == b"GGUF"
        version, n_tensors, n_kv = r.unpack("<I"), r.unpack("<Q"), r.unpack("<Q")
        kept: list[bytes] = []
        alignment = 32
        for _ in range(n_kv):
            start = f.tell()
            key = r.string()
            vtype = r.unpack("<I")
            value_at = f.tell()
            _skip_value(r, vtype)
            end = f.tell()
            if key == "general.alignment":
                f.seek(value_at)
                alignment = r.unpack(_SCALARS[vtype])
                f.seek(end)
            if key not in changes:
                f.seek(start)
                kept.append(f.read(end - start))
        infos_start = f.tell()
        for _ in range(n_tensors):
            r.skip_strings(1)
            n_dims = r.unpack("<I")
            f.seek(8 * n_dims + 4 + 8, 1)
        infos_end = f.tell()
        f.seek(infos_start)
        infos = f.read(infos_end - infos_start)
        data_offset = (infos_end + alignment - 1) // alignment * alignment
        with open(dst, "wb") as out:
            out.write(b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kept) + len(changes)))
            for raw in kept:
                out.write(raw)
            for key, value in changes.items():
                out.write(_encode(key, value))
            out.write(infos)
            out.write(b"\0" * (-out.tell() % alignment))
            f.seek(data_offset)
            shutil.copyfileobj(f, out, 1 << 22)
    return dst
