"""Reading an existing Ollama model store, for `localllm import --from-ollama`.

Ollama keeps `manifests/<host>/<namespace>/<name>/<tag>` (JSON, schema 2) and
`blobs/sha256-<hex>` under `~/.ollama/models` or `$OLLAMA_MODELS`. A manifest's layers name the
GGUF (`application/vnd.ollama.image.model`), the vision projector (`.projector`), the chat
template (`.template`, a Go template), the system prompt (`.system`) and the default
parameters (`.params`, JSON). Nothing here writes: cli/ollama_import.py stores what it finds.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from localllm.errors import UserError

from .names import BadModelName, ModelName, parse_name

OLLAMA_REGISTRY = "registry.ollama.ai"
OLLAMA_LIBRARY = "library"
MEDIA = "application/vnd.ollama.image."
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


class OllamaStoreError(UserError):
    """The Ollama store or one of its models cannot be read; the message says what to do."""


@dataclass(frozen=True)
class OllamaBlob:
    path: Path
    hexdigest: str  # Ollama names each blob by its content's sha256
    size: int


@dataclass
class OllamaModel:
    name: ModelName  # as localllm names it: `llama3.2:3b`, `owner/model:tag` off the library
    model: OllamaBlob
    projector: OllamaBlob | None = None
    template: str = ""
    system: str | None = None
    parameters: dict = field(default_factory=dict)
    license: str | None = None


def ollama_models_dir() -> Path:
    """Where Ollama keeps its models: $OLLAMA_MODELS, else ~/.ollama/models."""
    configured = os.environ.get("OLLAMA_MODELS")
    return Path(configured).expanduser() if configured else Path.home() / ".ollama" / "models"


def local_name(host: str, namespace: str, model: str, tag: str) -> ModelName:
    """Ollama's name as localllm stores it: the library's models keep their short name."""
    if host == OLLAMA_REGISTRY and namespace == OLLAMA_LIBRARY:
        return parse_name(f"{model}:{tag}")
    if host == OLLAMA_REGISTRY:
        return parse_name(f"{namespace}/{model}:{tag}")
    return parse_name(f"{host}/{namespace}/{model}:{tag}")


def manifest_paths(root: Path) -> list[tuple[Path, ModelName]]:
    """Every manifest in the store, with the name it gets here (unnameable ones left out)."""
    manifests = root / "manifests"
    found = []
    for path in sorted(manifests.glob("*/*/*/*")):
        if not path.is_file():
            continue
        host, namespace, model, tag = path.relative_to(manifests).parts
        try:
            found.append((path, local_name(host, namespace, model, tag)))
        except BadModelName:
            continue
    return found


def find_manifest(root: Path, wanted: str) -> tuple[Path, ModelName]:
    """The manifest of `wanted` (`llama3.2`, `llama3.2:3b`, `owner/model:tag`)."""
    name = parse_name(wanted)
    manifests = manifest_paths(root)
    for path, found in manifests:
        if found == name:
            return path, found
    # Ollama's own habit: `llama3.2` means its `latest` tag, which a store holding only
    # `llama3.2:1b` lacks. Name the tags it has, else the names nearest.
    tags = [str(found) for _, found in manifests if found.base == name.base]
    if tags:
        raise OllamaStoreError(f"the Ollama store {root} has no {name.tagged}, but has "
                               f"{', '.join(tags)}: name one (`localllm import --from-ollama "
                               f"{tags[0]}`)")
    close = difflib.get_close_matches(str(name), [str(found) for _, found in manifests], n=3)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    raise OllamaStoreError(f"no model {wanted!r} in the Ollama store {root}; {hint}(`localllm "
                           f"import --from-ollama` alone lists and imports all of them)")


def _blob(root: Path, layer: dict) -> OllamaBlob:
    match = _DIGEST.match(str(layer.get("digest", "")))
    if not match:
        raise OllamaStoreError(f"a layer has no sha256 digest: {layer.get('digest')!r}")
    path = root / "blobs" / f"sha256-{match.group(1)}"
    try:
        size = path.stat().st_size
    except OSError:
        raise OllamaStoreError(f"blob {path.name} is missing from {root / 'blobs'}") from None
    declared = layer.get("size", size)
    if isinstance(declared, bool) or not isinstance(declared, int):
        raise OllamaStoreError(f"blob {path.name}: its manifest gives the size {declared!r}")
    if declared != size:
        raise OllamaStoreError(f"blob {path.name} is {size} bytes, its manifest says "
                               f"{layer['size']}: Ollama's copy is damaged (ollama pull again)")
    return OllamaBlob(path, match.group(1), size)


def read_model(root: Path, path: Path, name: ModelName) -> OllamaModel:
    """The model a manifest describes; OllamaStoreError naming what is odd about it (a
    manifest of any shape is said so, never a traceback)."""
    try:
        return _read_model(root, path, name)
    except OllamaStoreError:
        raise
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise OllamaStoreError(f"cannot read the Ollama manifest {path} "
                               f"({type(e).__name__}: {e})") from None


def _read_model(root: Path, path: Path, name: ModelName) -> OllamaModel:
    doc = json.loads(path.read_bytes().decode("utf-8"))
    layers = [layer for layer in doc["layers"]]
    if not all(isinstance(layer, dict) for layer in layers):
        raise OllamaStoreError(f"the Ollama manifest {path} has layers that are not objects")
    by_type = {str(layer.get("mediaType", "")).removeprefix(MEDIA): layer for layer in layers}
    if "model" not in by_type:
        raise OllamaStoreError(f"{name} has no GGUF layer in Ollama's store (a model of "
                               f"another kind, or a cloud model): nothing to import")
    model = OllamaModel(name, _blob(root, by_type["model"]))
    if "projector" in by_type:
        model.projector = _blob(root, by_type["projector"])
    if "template" in by_type:
        model.template = _blob(root, by_type["template"]).path.read_text(errors="replace")
    if "system" in by_type:
        model.system = _blob(root, by_type["system"]).path.read_text(errors="replace")
    if "license" in by_type:
        model.license = _blob(root, by_type["license"]).path.read_text(errors="replace")
    if "params" in by_type:
        try:
            params = json.loads(_blob(root, by_type["params"]).path.read_text())
        except ValueError:
            params = {}
        model.parameters = params if isinstance(params, dict) else {}
    return model


def selected(root: Path, wanted: str | None = None) -> list[tuple[Path, ModelName]]:
    """The manifests to import: `wanted`'s alone, or every one the store holds."""
    if not (root / "manifests").is_dir():
        raise OllamaStoreError(f"no Ollama store at {root} (it has no manifests folder); set "
                               f"OLLAMA_MODELS to where Ollama keeps its models")
    return [find_manifest(root, wanted)] if wanted else manifest_paths(root)
