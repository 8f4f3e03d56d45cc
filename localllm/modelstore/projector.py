"""A vision projector (mmproj) GGUF as the store, /api/show and the tuner see it: what kind it
is and what it costs, read from its header (no weights read)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .gguf_header import read_header


@dataclass(frozen=True)
class ProjectorInfo:
    projector_type: str
    image_size: int
    patch_size: int
    n_embd: int
    n_layer: int
    n_embd_text: int
    tokens_per_image: int | None  # None: depends on the image (dynamic-resolution types)
    weight_bytes: int


def projector_info(path: str | Path) -> ProjectorInfo:
    header = read_header(path)
    md = header.metadata

    def num(key: str) -> int:
        value = md.get(key)
        return int(value) if isinstance(value, (int, float)) else 0

    kind = str(md.get("clip.projector_type") or md.get("clip.vision.projector_type") or "")
    size, patch = num("clip.vision.image_size"), num("clip.vision.patch_size")
    tokens = None
    if kind == "gemma3" and size and patch:
        merge = num("clip.vision.projector.scale_factor") or 4
        tokens = (size // patch // merge) ** 2
    return ProjectorInfo(
        projector_type=kind, image_size=size, patch_size=patch,
        n_embd=num("clip.vision.embedding_length"), n_layer=num("clip.vision.block_count"),
        n_embd_text=num("clip.vision.projection_dim"), tokens_per_image=tokens,
        weight_bytes=sum(t.n_bytes for t in header.tensors))


def show_info(info: ProjectorInfo) -> dict:
    """Ollama's /api/show `projector_info`: the clip.* keys it reports, as Ollama names them."""
    return {"general.architecture": "clip", "clip.projector_type": info.projector_type,
            "clip.vision.image_size": info.image_size,
            "clip.vision.patch_size": info.patch_size,
            "clip.vision.embedding_length": info.n_embd,
            "clip.vision.block_count": info.n_layer,
            "clip.vision.projection_dim": info.n_embd_text,
            **({"clip.vision.tokens_per_image": info.tokens_per_image}
               if info.tokens_per_image else {})}
