"""A catalog entry's ModelShape without its file: "does 27b-q3 fit my card?" answered offline.

catalog_shapes.toml (next to this file) holds, per catalog entry, what the shape reader takes
from a GGUF header: the metadata keys it reads and the tensor table, written compactly (one
line per tensor name, type and dims, with the blocks that carry it). The shape is rebuilt by
the same `shape_from_header` a real file goes through, so the two cannot drift apart in how
they derive layer kinds, KV heads or recurrent state.

Each entry says where its figures come from:
  header   printed by scripts/catalog_shape.py from the very file the catalog pins (its
           sha256): as exact as reading the file
  derived  the published architecture config written as a synthetic header, each tensor's
           bytes scaled (`scale`) so they add up to the published file size: an estimate
           (the real quant mixes types per tensor, the header's vocabulary counts as weights)
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import Any

from gguf import GGMLQuantizationType

from localllm.errors import UserError
from .gguf_header import GGUFHeader, TensorEntry
from .names import BadModelName, ModelName, parse_name
from .shape import ModelShape, shape_from_header

HEADER, DERIVED = "header", "derived"
# The `{arch}.` metadata keys shape_from_header reads (and nothing else is kept).
SHAPE_KEYS = (
    "block_count", "nextn_predict_layers", "context_length", "embedding_length",
    "feed_forward_length", "attention.head_count", "attention.head_count_kv",
    "attention.key_length", "attention.value_length", "attention.sliding_window",
    "attention.sliding_window_pattern", "attention.recurrent_layers", "full_attention_interval",
    "expert_count", "expert_used_count", "expert_feed_forward_length",
    "expert_shared_feed_forward_length", "vocab_size", "ssm.conv_kernel", "ssm.inner_size",
    "ssm.state_size", "ssm.group_count",
)
GENERAL_KEYS = ("general.architecture", "general.name", "general.file_type")
_BLOCK_ITEM = re.compile(r"^(\d+)(?:-(\d+)(?:/(\d+))?)?$")


class CatalogShapeError(UserError, ValueError):
    """catalog_shapes.toml is malformed: a packaging bug, reported with the entry at fault."""


@dataclass(frozen=True)
class CatalogShape:
    name: str  # the catalog entry's name
    origin: str  # HEADER or DERIVED
    file_size: int
    n_vocab: int
    metadata: dict[str, Any]
    tensors: tuple[str, ...]  # "[blk.BLOCKS ]NAME TYPE DIMS" lines
    sha256: str = ""  # the file a HEADER shape was read from
    scale: float = 1.0  # DERIVED: published size / the synthetic table's bytes
    source: str = ""  # DERIVED: where the config comes from, in words

    @property
    def words(self) -> str:
        """Where the figures come from, for the line a user reads under a plan."""
        if self.origin == HEADER:
            return f"read from the GGUF header of the file it pins (sha256 {self.sha256[:12]}...)"
        return (f"derived from {self.source}; sizes are estimates scaled to the published file "
                "size")


# ---- block sets: "0-29", "3-63/4", "0-60/4,1-61/4,2-62/4" ------------------------------------

def parse_blocks(text: str) -> list[int]:
    """Block indices from items `a`, `a-b` or `a-b/s` (every s-th from a to b), comma-joined."""
    out: list[int] = []
    for item in text.split(","):
        m = _BLOCK_ITEM.match(item)
        if not m:
            raise ValueError(f"bad block set {text!r}")
        start = int(m.group(1))
        end = int(m.group(2)) if m.group(2) else start
        out += range(start, end + 1, int(m.group(3) or 1))
    return sorted(out)


def format_blocks(blocks: list[int]) -> str:
    """The shortest-looking cover of `blocks` by arithmetic runs, taken greedily from the
    lowest block: the longest run starting there (step 1 preferred on a tie)."""
    left = sorted(set(blocks))
    members = set(left)
    items = []
    while left:
        start = left[0]
        best = [start]
        for step in range(1, (left[-1] - start) + 1 if len(left) > 1 else 2):
            run = [start]
            while run[-1] + step in members:
                run.append(run[-1] + step)
            if len(run) > len(best):
                best = run
        step = best[1] - best[0] if len(best) > 1 else 1
        items.append(str(start) if len(best) == 1 else
                     f"{start}-{best[-1]}" + (f"/{step}" if step > 1 else ""))
        members -= set(best)
        left = sorted(members)
    return ",".join(items)


# ---- the tensor lines ------------------------------------------------------------------------

@dataclass(frozen=True)
class _ScaledTensor(TensorEntry):
    """A tensor whose bytes are an estimate (a DERIVED shape), not its type's exact size."""

    scaled_bytes: int = 0

    @property
    def n_bytes(self) -> int:
        return self.scaled_bytes


def expand_tensors(lines: tuple[str, ...], scale: float = 1.0) -> tuple[TensorEntry, ...]:
    """The tensor table the lines describe (offsets are 0: nothing reads data through them)."""
    out: list[TensorEntry] = []
    for line in lines:
        words = line.split()
        if len(words) == 4 and words[0].startswith("blk."):
            names = [f"blk.{b}.{words[1]}" for b in parse_blocks(words[0][4:])]
            ggml, dims = words[2], words[3]
        elif len(words) == 3:
            names, ggml, dims = [words[0]], words[1], words[2]
        else:
            raise ValueError(f"bad tensor line {line!r}")
        kind = GGMLQuantizationType[ggml]
        shape = tuple(int(d) for d in dims.split("x"))
        for name in names:
            entry = TensorEntry(name, kind, shape, 0)
            if scale != 1.0:
                entry = _ScaledTensor(name, kind, shape, 0, round(entry.n_bytes * scale))
            out.append(entry)
    return tuple(out)


def tensor_lines(tensors: tuple[TensorEntry, ...]) -> list[str]:
    """The compact lines for a header's tensor table (scripts/catalog_shape.py prints them):
    a block's tensor grouped with the same name, type and dims in other blocks."""
    top: list[str] = []
    groups: dict[tuple[str, str, str], list[int]] = {}
    for t in tensors:
        dims = "x".join(str(d) for d in t.shape)
        m = re.match(r"^blk\.(\d+)\.(.+)$", t.name)
        if m is None:
            top.append(f"{t.name} {t.ggml_type.name} {dims}")
        else:
            groups.setdefault((m.group(2), t.ggml_type.name, dims), []).append(int(m.group(1)))
    blocks = [f"blk.{format_blocks(b)} {suffix} {ggml} {dims}"
              for (suffix, ggml, dims), b in sorted(groups.items(), key=lambda kv: (
                  kv[0][0], min(kv[1])))]
    return sorted(top) + blocks


# ---- the file --------------------------------------------------------------------------------

def parse_shapes(text: str) -> dict[ModelName, CatalogShape]:
    """catalog_shapes.toml text -> each entry's shape description, by the entry's name
    (pure)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CatalogShapeError(f"catalog_shapes.toml: {e}") from None
    out = {}
    for name, raw in doc.items():
        where = f"catalog_shapes.toml [{name!r}]"
        try:
            shape = CatalogShape(
                name=name, origin=raw["origin"], file_size=int(raw["file_size"]),
                n_vocab=int(raw["n_vocab"]), metadata=dict(raw["metadata"]),
                tensors=tuple(raw["tensors"]), sha256=str(raw.get("sha256", "")),
                scale=float(raw.get("scale", 1.0)), source=str(raw.get("source", "")))
            expand_tensors(shape.tensors)  # a bad line fails here, not when a user plans
            model = parse_name(name)
        except (KeyError, TypeError, ValueError, BadModelName) as e:
            raise CatalogShapeError(f"{where}: {e!r}") from None
        if shape.origin not in (HEADER, DERIVED):
            raise CatalogShapeError(f"{where}: origin must be {HEADER!r} or {DERIVED!r}")
        if (shape.origin == HEADER) != bool(shape.sha256) or (shape.origin == DERIVED
                                                               and not shape.source):
            raise CatalogShapeError(f"{where}: a header shape names its file's sha256, a "
                                    "derived one its source")
        out[model] = shape
    return out


@functools.cache  # the file ships with the package: read once a process
def load_shapes() -> dict[ModelName, CatalogShape]:
    return parse_shapes(resources.files(__package__).joinpath("catalog_shapes.toml").read_text())


def header_of(shape: CatalogShape) -> GGUFHeader:
    """The header the shape stands for: its metadata, its tensors, its file's size."""
    return GGUFHeader(version=3, metadata=dict(shape.metadata),
                      array_lengths={"tokenizer.ggml.tokens": shape.n_vocab},
                      tensors=expand_tensors(shape.tensors, shape.scale), data_offset=0,
                      file_size=shape.file_size)


def lookup_shape(entry_name: ModelName) -> CatalogShape | None:
    """The shape catalog_shapes.toml carries for a catalog entry (by its main name), or None."""
    return load_shapes().get(entry_name)


def model_shape(shape: CatalogShape) -> ModelShape:
    """The ModelShape the planner reads, built as a real header's is (path: `catalog:NAME`,
    which no file has, so nothing tries to open it)."""
    return shape_from_header(header_of(shape), f"catalog:{shape.name}")


def pins_file(shape: CatalogShape, sha256: str | None) -> bool:
    """Whether the shape was read from the very file the catalog entry pins: then the hub can
    tell nothing more about it."""
    return shape.origin == HEADER and sha256 is not None and shape.sha256 == sha256
