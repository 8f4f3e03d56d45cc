"""Model names: `name[:tag]`, with optional path parts (`hf.co/owner/repo:Q4_K_M`).

A name maps to a manifest path inside the store, so every part is checked here: no part may
be empty, `.` or `..`, or hold characters outside a conservative set. That keeps any name a
client sends from reaching outside the store.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property

from localllm.errors import UserError

DEFAULT_TAG = "latest"
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


class BadModelName(UserError, ValueError):
    pass


@dataclass(frozen=True, order=True)
class ModelName:
    parts: tuple[str, ...]  # path parts; usually one
    tag: str

    @property
    def base(self) -> str:
        return "/".join(self.parts)

    @cached_property
    def tagged(self) -> str:
        """`base:tag`, as replies name the model. Kept once worked out: the daemon keeps the
        entries of the models it serves (daemon/api/common.py), so a warm request reads it."""
        return f"{self.base}:{self.tag}"

    def __str__(self) -> str:
        return self.tagged


def parse_name(text: str) -> ModelName:
    if not isinstance(text, str) or not text.strip():
        raise BadModelName("model name is empty")
    text = text.strip()
    base, tag = text, DEFAULT_TAG
    last = text.rsplit("/", 1)[-1]
    if ":" in last:
        base, tag = text.rsplit(":", 1)
    parts = tuple(base.split("/"))
    if len(parts) > 4:
        raise BadModelName(f"invalid model name {text!r}: too many '/' parts")
    for part in parts:
        if part in (".", "..") or not _PART.match(part) or ".." in part:
            raise BadModelName(
                f"invalid model name {text!r}: use letters, digits, '.', '_' and '-' "
                "(e.g. smollm2 or my-model:q4)"
            )
    if not _TAG.match(tag) or ".." in tag:
        raise BadModelName(f"invalid model tag {tag!r} in {text!r}")
    return ModelName(tuple(p.lower() for p in parts), tag)
