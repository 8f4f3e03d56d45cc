"""Read a GGUF file's header (metadata and tensor table) without touching the weights.

gguf's GGUFReader builds numpy views of every array (the 262k-entry vocabulary of Gemma takes
seconds), so this reader streams the header and keeps only what localllm needs: scalar and small
array metadata, the chat template, and each tensor's name, type and shape. Tokenizer arrays are
skipped by length. The gguf package supplies the type tables, so quant sizes are llama.cpp's own.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localllm.errors import UserError

GGUF_MAGIC = b"GGUF"
# Arrays longer than this are counted, not kept (vocabularies, merges, scores).
MAX_KEPT_ARRAY = 4096
# Bounds checked before anything is allocated for what a header declares: a file of a few KB
# must not make the daemon allocate gigabytes (each count is also held to what the file's bytes
# can hold: a key takes at least 13 bytes, a tensor entry 24, an array item 1).
MAX_STRING = 64 << 20  # a metadata string kept (chat templates are KBs)
MAX_NESTING = 3  # arrays of arrays of arrays; GGUF files in use nest none
MAX_KEPT_ITEMS = 1 << 20  # array items kept over the whole header
MAX_BLOCKS = 4096  # llama.cpp's own limit is 512 (LLAMA_MAX_LAYERS)
_MIN_KEY_BYTES, _MIN_TENSOR_BYTES = 13, 24
# Metadata numbers the shape and the chat layer read (`{arch}.` + these): whole numbers >= 0
# (or, for the per-layer ones, arrays of them), checked once here so each reader can trust them.
_COUNT_KEYS = ("block_count", "context_length", "embedding_length", "feed_forward_length",
               "attention.head_count", "attention.head_count_kv", "attention.key_length",
               "attention.value_length", "attention.sliding_window", "expert_count",
               "expert_used_count", "expert_feed_forward_length",
               "expert_shared_feed_forward_length", "nextn_predict_layers", "vocab_size",
               "full_attention_interval", "ssm.conv_kernel", "ssm.inner_size",
               "ssm.state_size", "ssm.group_count")
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")

_SCALARS = {  # GGUFValueType -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(UserError, ValueError):
    """The file is not a GGUF model localllm can read; the message says why, for a user."""


class HeaderTruncated(GGUFError):
    """The bytes end inside the header: a partial read (a range request) needs more of them."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    offset: int  # relative to the start of the data section

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.ggml_type]
        return self.n_elements // block * type_size


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # long arrays appear as their length in `array_lengths` only
    array_lengths: dict[str, int]
    tensors: tuple[TensorEntry, ...]
    data_offset: int
    file_size: int


class _Reader:
    def __init__(self, f: BinaryIO, path: Path, file_size: int | None = None):
        self.f = f
        self.path = path
        self.file_size = file_size
        self.kept_items = 0

    def left(self) -> int | None:
        """Bytes the file has after the current position (None: not known)."""
        return None if self.file_size is None else self.file_size - self.f.tell()

    def claims(self, n: int, unit: int, what: str) -> None:
        """GGUFError naming `what` when `n` items of at least `unit` bytes cannot fit in the
        rest of the file: checked before anything is read or allocated for them."""
        left = self.left()
        if left is not None and n * unit > left:
            raise GGUFError(f"{self.path} is corrupt: {what} claims {n} items but only "
                            f"{left} bytes follow")

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise HeaderTruncated(f"{self.path} is truncated: its GGUF header ends early")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def _length(self, what: str) -> int:
        n = self.unpack("<Q")
        left = self.left()
        if n > MAX_STRING or (left is not None and n > left):
            raise GGUFError(f"{self.path} is corrupt: the string of {what} claims {n} bytes")
        return n

    def string(self, what: str = "a header key") -> str:
        return self.read(self._length(what)).decode("utf-8", errors="replace")

    def skip_strings(self, count: int, what: str = "an array") -> None:
        for _ in range(count):
            self.f.seek(self._length(what), 1)

    def value(self, vtype: int, key: str, array_lengths: dict[str, int], depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string(key)
        if vtype == _ARRAY:
            if depth >= MAX_NESTING:
                raise GGUFError(f"{self.path} is corrupt: {key} nests arrays more than "
                                f"{MAX_NESTING} deep")
            item_type = self.unpack("<I")
            count = self.unpack("<Q")
            self.claims(count, 1, f"the array {key}")
            array_lengths[key] = count
            if count > MAX_KEPT_ARRAY:
                if item_type == _STRING:
                    self.skip_strings(count, key)
                elif item_type in _SCALARS:
                    self.claims(count, struct.calcsize(_SCALARS[item_type]), f"the array {key}")
                    self.f.seek(count * struct.calcsize(_SCALARS[item_type]), 1)
                else:
                    raise GGUFError(f"{self.path}: unsupported nested array in {key}")
                return None
            self.kept_items += count
            if self.kept_items > MAX_KEPT_ITEMS:
                raise GGUFError(f"{self.path} is corrupt: its arrays (at {key}) hold more "
                                f"than {MAX_KEPT_ITEMS} short items")
            return [self.value(item_type, key, {}, depth + 1) for _ in range(count)]
        raise GGUFError(f"{self.path} is corrupt: unknown metadata type {vtype} for {key}")


def read_header(path: str | Path) -> GGUFHeader:
    """Parse the header; raise GGUFError when the file is not GGUF, corrupt or truncated."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        f = path.open("rb")
    except OSError as e:
        raise GGUFError(f"cannot read {path}: {e.strerror}") from None
    with f:
        header = parse_header(f, path, file_size)
    _check_complete(header, path)
    return header


def parse_header(f: BinaryIO, path: str | Path, file_size: int) -> GGUFHeader:
    """The header from a file object holding at least the header's bytes (the whole file, or
    the first bytes of a remote one); HeaderTruncated when they end inside the header. Whether
    the tensor data is all there is not checked: `file_size` is what the file says it has."""
    r = _Reader(f, path, file_size)
    if f.read(4) != GGUF_MAGIC:
        raise GGUFError(f"{path} is not a GGUF model file (wrong magic bytes)")
    version = r.unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path} has GGUF version {version}; localllm reads versions 2 and 3")
    n_tensors = r.unpack("<Q")
    n_kv = r.unpack("<Q")
    if n_tensors > 1 << 20:
        raise GGUFError(f"{path} is corrupt: its tensor count {n_tensors} is implausible")
    if n_kv > 1 << 20:
        raise GGUFError(f"{path} is corrupt: its metadata key count {n_kv} is implausible")
    r.claims(n_kv, _MIN_KEY_BYTES, "the metadata key count")
    r.claims(n_tensors, _MIN_TENSOR_BYTES, "the tensor count")
    metadata: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = r.string()
        vtype = r.unpack("<I")
        metadata[key] = r.value(vtype, key, array_lengths)
    _check_counts(metadata, path)
    tensors = []
    for _ in range(n_tensors):
        name = r.string("a tensor name")
        n_dims = r.unpack("<I")
        if n_dims > 8:
            raise GGUFError(f"{path} is corrupt: tensor {name} has {n_dims} dimensions")
        shape = tuple(r.unpack("<Q") for _ in range(n_dims))
        raw_type = r.unpack("<I")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name} has unknown type {raw_type}") from None
        tensors.append(TensorEntry(name, ggml_type, shape, r.unpack("<Q")))
    alignment = metadata.get("general.alignment", 32)
    if not _whole(alignment) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path} is corrupt: general.alignment is {_shown(alignment)}, not a "
                        f"power of two")
    pos = f.tell()
    data_offset = (pos + alignment - 1) // alignment * alignment
    return GGUFHeader(version, metadata, array_lengths, tuple(tensors), data_offset, file_size)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _check_counts(metadata: dict[str, Any], path: str | Path) -> None:
    """The architecture's counts as whole numbers >= 0 (per-layer ones as arrays of them),
    the block count at most MAX_BLOCKS: a GGUFError naming the key otherwise."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        return
    for name in _COUNT_KEYS:
        key = f"{arch}.{name}"
        if key not in metadata or metadata[key] is None:  # None: a long array, counted only
            continue
        value = metadata[key]
        items = value if isinstance(value, list) and name in _PER_LAYER_KEYS else [value]
        if not all(_whole(v) and v >= 0 for v in items):
            raise GGUFError(f"{path} is corrupt: {key} is {_shown(value)}, not a whole number "
                            f">= 0")
        if name == "block_count" and value > MAX_BLOCKS:
            raise GGUFError(f"{path} is corrupt: {key} is {value}, more than the "
                            f"{MAX_BLOCKS} blocks any model has")


def _check_complete(header: GGUFHeader, path: Path) -> None:
    """A truncated download still has a whole header; its tensor data ends early."""
    if not header.tensors:
        return
    end = max(header.data_offset + t.offset + t.n_bytes for t in header.tensors)
    if end > header.file_size:
        raise GGUFError(
            f"{path} is truncated: its tensors need {end} bytes but the file has "
            f"{header.file_size}; download or copy it again"
        )


def read_token_pieces(path: str | Path, ids: set[int]) -> dict[int, str]:
    """The vocabulary strings of a few token ids (BOS, EOS, FIM markers), read from the header
    without keeping the whole vocabulary. Ids outside the vocabulary are left out."""
    path = Path(path)
    wanted: dict[int, str] = {}
    with path.open("rb") as f:
        r = _Reader(f, path, path.stat().st_size)
        if f.read(4) != GGUF_MAGIC:
            raise GGUFError(f"{path} is not a GGUF model file (wrong magic bytes)")
        r.unpack("<I")
        r.unpack("<Q")
        n_kv = r.unpack("<Q")
        for _ in range(n_kv):
            key = r.string()
            vtype = r.unpack("<I")
            if key != "tokenizer.ggml.tokens" or vtype != _ARRAY:
                r.value(vtype, key, {})
                continue
            r.unpack("<I")
            count = r.unpack("<Q")
            last = max(ids, default=-1)
            for i in range(count):
                if i > last:
                    return wanted
                if i in ids:
                    wanted[i] = r.string()
                else:
                    r.skip_strings(1)
            return wanted
    return wanted
