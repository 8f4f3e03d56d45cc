"""Sizes as people read them, one convention everywhere (`list`, `show`, `ps`, `pull`, the chat's
stats line): decimal units as Ollama prints them, whole KB and MB, GB and TB with one decimal.
Inputs that take a size (`--vram GiB`, config's memory sizes) say their own unit."""

from __future__ import annotations


def human_size(n: float) -> str:
    """Bytes -> "98 MB", "3.2 GB"."""
    for unit, scale, digits in (("TB", 1e12, 1), ("GB", 1e9, 1), ("MB", 1e6, 0), ("KB", 1e3, 0)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"
