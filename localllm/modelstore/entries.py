"""What the store holds, as values: the media types of a manifest's layers, a layer, a remote
model, and a stored model's entry (what `ModelStore.get` and `list` give); with the blob hash
and the `details` Ollama's routes show. Kept apart from store.py, which reads and writes them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .names import ModelName
from .shape import ModelShape, format_param_count

_CHUNK = 1 << 22

MODEL_LAYER = "application/vnd.localllm.model"
DRAFT_LAYER = "application/vnd.localllm.draft"
MTP_LAYER = "application/vnd.localllm.mtp"
PROJECTOR_LAYER = "application/vnd.ollama.image.projector"  # Ollama's name for an mmproj
_LEGACY_LAYERS = {"application/vnd.localllm.projector": PROJECTOR_LAYER}  # read as the above
COMPANION_LAYERS = (DRAFT_LAYER, MTP_LAYER, PROJECTOR_LAYER)

@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # "sha256:<hex>"
    size: int


@dataclass(frozen=True)
class RemoteModel:
    """A model served by an OpenAI-compatible server: nothing of it is stored here."""

    url: str  # the API's base, ending in /v1; it may carry credentials (user:secret@)
    model: str  # the upstream's name for it
    api_key_env: str = ""  # the daemon's environment variable holding the key, if any

    @property
    def shown_url(self) -> str:
        """The URL as every output shows it: credentials as `***`."""
        return shown_url(self.url)


def shown_url(url: str) -> str:
    """`url` with any credentials it carries (user and password) as `***`."""
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    if not sep or "@" not in host:
        return url
    return f"{scheme}://***@{host.rpartition('@')[2]}{slash}{path}"


@dataclass(frozen=True)
class ModelEntry:
    name: ModelName
    layers: tuple[Layer, ...]
    details: dict
    source: str
    modified_at: str  # ISO 8601
    model_path: Path | None  # None for a remote model
    remote: RemoteModel | None = None

    @property
    def model_layer(self) -> Layer:
        return next(layer for layer in self.layers if layer.media_type == MODEL_LAYER)

    # Worked out once per entry: the daemon keeps the entries of the models it serves, and every
    # request to one compares or keys by these.
    @cached_property
    def digest(self) -> str:
        if self.remote is not None:  # stable for the same upstream, as a blob's would be
            text = json.dumps([self.remote.url, self.remote.model])
            return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
        return self.model_layer.digest

    @cached_property
    def manifest_digest(self) -> str:
        """What names this model as a whole, as Ollama's tags digest does: any layer (the
        template, the parameters, a companion) changes it; a copy keeps it."""
        if self.remote is not None:
            return self.digest
        text = json.dumps([[layer.media_type, layer.digest] for layer in self.layers])
        return "sha256:" + hashlib.sha256(text.encode()).hexdigest()

    @property
    def size(self) -> int:
        return sum(layer.size for layer in self.layers)

    def companion(self, media_type: str) -> Layer | None:
        return next((layer for layer in self.layers if layer.media_type == media_type), None)


def sha256_file(path: Path, progress=None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress:
                progress(len(chunk))
    return h.hexdigest()


def model_details(shape: ModelShape) -> dict:
    """The `details` object of Ollama's /api/tags and /api/show."""
    return {
        "format": "gguf",
        "family": shape.architecture,
        "families": [shape.architecture],
        "parameter_size": format_param_count(shape.n_params),
        "quantization_level": shape.file_type,
    }

