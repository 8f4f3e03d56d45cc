"""The prompt cache's files: one saved sequence per file (engine/state.py's `SavedSequence`, with
its checkpoints), the key that says which contexts may take it back, and the checks that keep a
damaged file from ever reaching llama.cpp.

    MAGIC (8 bytes) | header length (u32, little-endian) | header (JSON) | payload

The payload is the tokens (int64, little-endian: an image's placeholder is a negative 62-bit
number, engine/vision.py), the sequence's state (`llama_state_seq_get_data`), then each
checkpoint's state in the header's order. The header says how long each part is, the payload's
length and its SHA-256. A file is read only when its magic, header, length and hash all agree,
and only into a context whose key equals the one in its header: llama.cpp checks a state's
layout but not its values, so a flipped byte would otherwise become a wrong answer.

The key is what makes two contexts' KV interchangeable (state.py: same model, KV types and
number of sequences; a larger n_ctx is fine): the model file (its store digest, size and
modification time: an edited file is another model), the binding's version (llama.cpp's state
layout may change), K and V types, flash attention (V is stored transposed without it),
sequences per context, the recurrent-state snapshots, and for a sliding-window model the
window, `swa_full` and the micro-batch (the SWA cache holds window + micro-batch cells).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
from localllm.engine.state import Checkpoint, SavedSequence
from localllm.planner.plan import Plan

from localllm.paths import replace_private_parts

MAGIC = b"LLMKVC1\n"
VERSION = 1
SUFFIX = ".kv"
_LENGTH = struct.Struct("<I")
MAX_HEADER = 1 << 24  # a 128K-token prompt's tokens are not in the header: far below this


class DamagedFile(ValueError):
    """A file that is not a whole, intact prompt-cache file of the key asked for."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint as the index knows it before its bytes are read (SlotCheckpoints reads
    only `n_tokens`)."""

    n_tokens: int
    kind: str
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    """A file's header and tokens: what matching a prompt needs (reuse.py's rules read
    `tokens`, `pos_min` and `checkpoints`), without the state itself."""

    path: Path
    tokens: tuple[int, ...]
    pos_min: int
    checkpoints: tuple[CheckpointInfo, ...]
    state_bytes: int
    nbytes: int  # the file's size
    key: str


def model_identity(path: str | Path) -> str:
    """The model file as the key knows it: the store names a blob by its content's digest;
    size and modification time tell an edited or replaced file apart."""
    p = Path(path)
    info = p.stat()
    name = p.name if p.name.startswith("sha256-") else str(p.resolve())
    return f"{name}:{info.st_size}:{info.st_mtime_ns}"


def kv_key(model_path: str | Path, plan: Plan, lm) -> str:
    """The key of a context (engine/model.py's LlamaModel `lm`, loaded with `plan`): equal keys
    hold interchangeable sequence states. Hex, the name of the key's folder."""
    swa = bool(lm.n_swa)
    fields = {
        "model": model_identity(model_path), "llama_cpp": llama_cpp.__version__,
        "type_k": plan.type_k, "type_v": plan.type_v, "flash_attn": plan.flash_attn,
        "n_seq": lm.n_seq, "recurrent": lm.recurrent, "n_rs_seq": lm.n_rollback,
        "n_swa": lm.n_swa, "swa_full": plan.swa_full,
        "n_ubatch": int(llama_cpp.llama_n_ubatch(lm.ctx)) if swa else 0,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def file_name(tokens: tuple[int, ...] | list[int]) -> str:
    """A file's name: its tokens' digest (one file per prompt and key)."""
    return hashlib.sha256(struct.pack(f"<{len(tokens)}q", *tokens)).hexdigest()[:32] + SUFFIX


def write(path: Path, saved: SavedSequence, key: str) -> int:
    """Write `saved` to `path` whole (a temporary file renamed over it, 0600); its size."""
    token_bytes = struct.pack(f"<{len(saved.tokens)}q", *saved.tokens)
    parts = [token_bytes, memoryview(saved.data).cast("B"),
             *(memoryview(c.data).cast("B") for c in saved.checkpoints)]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)
    header = json.dumps({
        "version": VERSION, "key": key, "n_tokens": len(saved.tokens),
        "pos_min": saved.pos_min, "state_bytes": len(saved.data),
        "checkpoints": [{"n_tokens": c.n_tokens, "kind": c.kind, "bytes": c.nbytes}
                        for c in saved.checkpoints],
        "payload_bytes": sum(len(p) for p in parts), "payload_sha256": digest.hexdigest(),
    }).encode()
    replace_private_parts(path, [MAGIC, _LENGTH.pack(len(header)), header, *parts])
    return len(MAGIC) + _LENGTH.size + len(header) + sum(len(p) for p in parts)


def read_entry(path: Path, key: str) -> FileEntry:
    """A file's header and tokens, checked as far as they go without the hash (the magic, the
    header, the key, the file's length); DamagedFile otherwise."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _header(f, size)
        if header["key"] != key:
            raise DamagedFile("made for another model or KV layout")
        n = header["n_tokens"]
        tokens = f.read(8 * n)
    if len(tokens) != 8 * n:
        raise DamagedFile("cut short in its tokens")
    if start + header["payload_bytes"] != size:
        raise DamagedFile(f"{size} bytes where its header says {start + header['payload_bytes']}")
    try:
        checkpoints = tuple(CheckpointInfo(int(c["n_tokens"]), str(c["kind"]),
                                           int(c["bytes"])) for c in header["checkpoints"])
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedFile(f"its checkpoints do not read ({type(e).__name__})") from None
    return FileEntry(path, struct.unpack(f"<{n}q", tokens), header["pos_min"],
                     checkpoints, header["state_bytes"], size, key)


def read_saved(entry: FileEntry) -> SavedSequence:
    """The whole file as a SavedSequence, its payload hashed first; DamagedFile when anything
    differs from what its header and the index said."""
    with open(entry.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header, start = _header(f, size)
        if header["key"] != entry.key or header["n_tokens"] != len(entry.tokens):
            raise DamagedFile("its header changed since it was indexed")
        payload = bytearray(header["payload_bytes"])
        if f.readinto(payload) != len(payload) or f.read(1):
            raise DamagedFile("not the length its header says")
    if hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise DamagedFile("its bytes do not match their hash")
    view = memoryview(payload)
    at = 8 * len(entry.tokens)
    if tuple(struct.unpack_from(f"<{len(entry.tokens)}q", view)) != entry.tokens:
        raise DamagedFile("its tokens changed since it was indexed")
    sizes = [int(header["state_bytes"]), *(c.nbytes for c in entry.checkpoints)]
    if at + sum(sizes) != len(payload) or any(s <= 0 for s in sizes):
        raise DamagedFile("its parts do not add up to its payload")
    arrays = []
    for n in sizes:  # views of the one buffer: no copy
        arrays.append((ctypes.c_uint8 * n).from_buffer(payload, at))
        at += n
    checkpoints = tuple(Checkpoint(c.n_tokens, data, c.kind)
                        for c, data in zip(entry.checkpoints, arrays[1:], strict=True))
    return SavedSequence(entry.tokens, arrays[0], entry.pos_min, checkpoints=checkpoints)


def _header(f, size: int) -> tuple[dict, int]:
    head = f.read(len(MAGIC) + _LENGTH.size)
    if len(head) != len(MAGIC) + _LENGTH.size or head[:len(MAGIC)] != MAGIC:
        raise DamagedFile("not a prompt-cache file (its first bytes)")
    (length,) = _LENGTH.unpack(head[len(MAGIC):])
    if length > min(MAX_HEADER, size):
        raise DamagedFile(f"a header of {length} bytes")
    try:
        header = json.loads(f.read(length))
        kinds = {"version": int, "key": str, "n_tokens": int, "pos_min": int,
                 "state_bytes": int, "payload_bytes": int, "checkpoints": list,
                 "payload_sha256": str}
        wrong = [name for name, kind in kinds.items() if not isinstance(header[name], kind)]
    except (ValueError, KeyError, TypeError) as e:  # not JSON, not an object, a field missing
        raise DamagedFile(f"its header does not read ({type(e).__name__})") from None
    if wrong or header["version"] != VERSION or min(
            header[n] for n in ("n_tokens", "pos_min", "state_bytes", "payload_bytes")) < 0:
        raise DamagedFile(f"its header's {', '.join(wrong) or 'version or sizes'} are wrong")
    return header, len(MAGIC) + _LENGTH.size + length
