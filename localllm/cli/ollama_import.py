"""`localllm import --from-ollama [NAME]`: the models Ollama already pulled, without a second
download. Each GGUF blob is hard-linked into this store (one file on disk for both) when it is
already yours and 0600, or copied otherwise, with a note saying why: a link to a wider file would
leave it readable through Ollama's name, and narrowing it would change the mode of your file.
The system prompt and parameters come along through the same recipe `localllm create` builds;
Ollama's chat template is a Go template, which localllm does not render, so the GGUF's own
(Jinja) template is used.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from dataclasses import dataclass, replace
from pathlib import Path

from localllm.errors import UserError
from localllm.modelstore.custom import (
    GO_TEMPLATE_NOTE,
    ModelfileError,
    check_template,
    parameter_value,
)
from localllm.modelstore.modelfile import Recipe, build
from localllm.modelstore.ollama_store import (
    OllamaBlob,
    OllamaStoreError,
    ollama_models_dir,
    read_model,
    selected,
)
from localllm.modelstore.gguf_header import GGUFError, read_header
from localllm.modelstore.store import (
    PROJECTOR_LAYER,
    Layer,
    ModelStore,
    StoreError,
    check_projector,
    check_room_to_copy,
    default_store,
    sha256_file,
)
from localllm.units import human_size

log = logging.getLogger("localllm.import")


@dataclass
class Staged:
    """A blob checked and waiting in the store's tmp/ to be published (path None: stored
    already), and how it got there."""

    blob: OllamaBlob
    path: Path | None
    how: str


def stage_blob(store: ModelStore, blob: OllamaBlob, copy: bool = False) -> Staged:
    """The blob in the store's tmp/, hashed on the way (one read; a blob that does not hash to
    its name is refused): hard-linked where it can be, copied where not. A symlink is copied,
    never linked (a link would point outside both stores). Nothing is published here."""
    if store.has_blob(f"sha256:{blob.hexdigest}"):
        return Staged(blob, None, "already stored")
    info = os.lstat(blob.path)
    if stat.S_ISLNK(info.st_mode):
        reason = "Ollama's blob is a symbolic link (its target is copied, never linked)"
    elif not stat.S_ISREG(info.st_mode):
        raise OllamaStoreError(f"Ollama's blob {blob.path} is not a regular file")
    elif copy:
        reason = "--copy asked for a copy"
    elif info.st_uid != os.getuid():
        reason = "Ollama's blob belongs to another user (a link would share their file)"
    elif stat.S_IMODE(info.st_mode) != 0o600:
        reason = (f"Ollama's blob is {stat.S_IMODE(info.st_mode):04o}, and the store is "
                  f"owner-only: a link would change your file's mode (`chmod 600` it for a "
                  f"link)")
    else:
        reason = ""
    staged = store.staging_file("ollama-")
    try:
        if not reason:
            started = time.perf_counter()
            _verify(blob, sha256_file(blob.path), started)
            staged.unlink()
            try:
                os.link(blob.path, staged, follow_symlinks=False)
                return Staged(blob, staged, "linked")
            except OSError as e:
                reason = f"a hard link failed ({e.strerror or e}; another filesystem?)"
                staged.touch(mode=0o600)
        check_room_to_copy(blob.path, blob.size, store.tmp, link=False)
        started = time.perf_counter()
        digest = hashlib.sha256()
        with blob.path.open("rb") as src, staged.open("wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
        _verify(blob, digest.hexdigest(), started)
        return Staged(blob, staged, f"copied {human_size(blob.size)}: {reason}")
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def _verify(blob: OllamaBlob, hexdigest: str, started: float) -> None:
    if hexdigest != blob.hexdigest:
        raise OllamaStoreError(f"Ollama's blob {blob.path.name} does not hash to its name (its "
                               f"content is sha256:{hexdigest[:12]}...): damaged, or not "
                               f"Ollama's (ollama pull the model again)")
    seconds = time.perf_counter() - started
    log.info("hashed %s in %.1f s (%s/s)", blob.path.name, seconds,
             human_size(int(blob.size / max(seconds, 1e-6))))


def discard(staged: list[Staged]) -> None:
    """Staged blobs of a model that was refused: gone, the store and Ollama's files as they
    were (a staged hard link shares the file; removing it changes nothing of Ollama's)."""
    for s in staged:
        if s.path is not None:
            s.path.unlink(missing_ok=True)


def recipe_for(model, digest: str) -> tuple[Recipe, list[str]]:
    """What `create` would build from the Ollama model's layers, and notes on what was left."""
    notes, parameters = [], {}
    for key, value in model.parameters.items():
        try:
            if key == "stop":
                stops = value if isinstance(value, list) else [value]
                parameters["stop"] = [parameter_value("stop", s) for s in stops]
            else:
                parameters[key] = parameter_value(key, value)
        except ModelfileError:
            notes.append(f"parameter {key} left out (localllm has no such option)")
    template = None
    if model.template:
        try:
            template = check_template(model.template)
        except ModelfileError:
            notes.append(GO_TEMPLATE_NOTE)
    return Recipe(base=digest, parameters=parameters, template=template,
                  system=model.system, license=model.license), notes


def import_one(store: ModelStore, root, path, name, copy: bool) -> str:
    """Every blob checked first (hashed, the model a GGUF, the projector a projector), then the
    blobs published, the manifest last: a model refused leaves nothing behind, no blob and no
    changed mode."""
    model = read_model(root, path, name)
    staged: list[Staged] = []
    try:
        staged.append(stage_blob(store, model.model, copy))
        _check_model(staged[0])
        if model.projector is not None:
            staged.append(stage_blob(store, model.projector, copy))
            _check_projector(staged[1])
    except BaseException:
        discard(staged)
        raise
    for s in staged:
        if s.path is not None:
            store.publish_blob(s.path, s.blob.hexdigest)
    digest = f"sha256:{model.model.hexdigest}"
    recipe, notes = recipe_for(model, digest)
    if model.projector is not None:
        recipe = replace(recipe, layers=(Layer(PROJECTOR_LAYER,
                                               f"sha256:{model.projector.hexdigest}",
                                               model.projector.size),))
        notes.append(f"vision projector {staged[1].how}")
    build(store, str(name), recipe)
    kept = [what for what, there in (("system prompt", recipe.system),
                                     (f"{len(recipe.parameters)} parameter(s)",
                                      recipe.parameters)) if there]
    said = "; ".join([f"{staged[0].how}, {human_size(model.model.size)}", *kept, *notes])
    return f"imported {name} ({said})"


def _check_model(staged: Staged) -> None:
    path = staged.path or staged.blob.path
    try:
        read_header(path)
    except GGUFError as e:
        raise OllamaStoreError(f"Ollama's model blob {staged.blob.path.name} is not a GGUF "
                               f"({e}): nothing imported") from None


def _check_projector(staged: Staged) -> None:
    try:
        check_projector(staged.path or staged.blob.path)
    except StoreError as e:
        raise OllamaStoreError(f"Ollama's vision projector {staged.blob.path.name} cannot be "
                               f"used ({e}): nothing imported") from None


def import_from_ollama(wanted: str | None, force: bool, copy: bool = False) -> int:
    """Import `wanted` (an error says why not), or every model that can be (the others are
    listed as skipped, with the reason)."""
    root = ollama_models_dir()
    store = default_store()
    found = selected(root, wanted)
    if not found:
        raise UserError(f"the Ollama store {root} holds no models")
    for path, name in found:
        try:
            if store.exists(name) and not force:
                raise UserError(f"{name} is already stored; --force replaces it")
            print(import_one(store, root, path, name, copy))
        except (UserError, OSError) as e:
            if wanted:
                raise
            print(f"skipped {name}: {e}")
    return 0
