"""`localllm import --from-ollama [NAME]`: the models Ollama already pulled, without a second
download. Each GGUF blob is hard-linked into this store (one file on disk for both), or copied
where a link cannot be made, with a note saying why. The system prompt and parameters come
along through the same recipe `localllm create` builds; Ollama's chat template is a Go template,
which localllm does not render, so the GGUF's own (Jinja) template is used.
"""

from __future__ import annotations

import os
import stat

from localllm.daemon.api.create import Recipe, build
from localllm.daemon.chat.custom import ModelfileError, check_template, parameter_value
from localllm.errors import UserError
from localllm.modelstore.ollama_store import (
    OllamaBlob,
    OllamaStoreError,
    ollama_models_dir,
    read_model,
    selected,
)
from localllm.modelstore.store import (
    PROJECTOR_LAYER,
    Layer,
    ModelStore,
    default_store,
    sha256_file,
)
from localllm.units import human_size


def store_blob(store: ModelStore, blob: OllamaBlob, copy: bool = False) -> tuple[str, str]:
    """The blob in this store, linked when it can be; (digest, how it got there)."""
    digest = f"sha256:{blob.hexdigest}"
    if store.has_blob(digest):
        return digest, "already stored"
    reason = "--copy asked for a copy"
    if not copy:
        reason = link_blob(store, blob)
        if reason.startswith("linked"):
            return digest, reason
    # A copy is read whole anyway: check it is what its name says before storing it.
    if sha256_file(blob.path) != blob.hexdigest:
        raise OllamaStoreError(f"Ollama's blob {blob.path} does not hash to its name: it is "
                               f"damaged (ollama pull the model again)")
    store.add_blob(blob.path, link=False)
    return digest, f"copied {human_size(blob.size)}: {reason}"


def link_blob(store: ModelStore, blob: OllamaBlob) -> str:
    """Hard-link the blob in; "linked..." when done, else why it could not be."""
    info = blob.path.stat()
    if info.st_uid != os.getuid():
        return "Ollama's blob belongs to another user (a link would share their file)"
    staged = store.staging_file("ollama-")
    staged.unlink()
    try:
        os.link(blob.path, staged)
    except OSError as e:
        return f"a hard link failed ({e.strerror or e}; another filesystem?)"
    store.publish_blob(staged, blob.hexdigest)  # owner-only (0600), as every blob here
    mode = stat.S_IMODE(info.st_mode)
    if mode != 0o600:
        return (f"linked; the file is now owner-only (0600, was {mode:04o}): it is one file "
                f"in both stores, which Ollama, running as you, still reads")
    return "linked"


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
            notes.append("Ollama's Go template left out: the GGUF's own chat template is used")
    return Recipe(base=digest, parameters=parameters, template=template,
                  system=model.system), notes


def import_one(store: ModelStore, root, path, name, copy: bool) -> str:
    model = read_model(root, path, name)
    digest, how = store_blob(store, model.model, copy)
    recipe, notes = recipe_for(model, digest)
    build(store, str(name), recipe)
    if model.projector is not None:
        proj_digest, proj_how = store_blob(store, model.projector, copy)
        entry = store.get(name)
        store.write_manifest(name, [*entry.layers, Layer(PROJECTOR_LAYER, proj_digest,
                                                         model.projector.size)],
                             entry.details, f"ollama:{path}")
        notes.append(f"vision projector {proj_how}")
    kept = [what for what, there in (("system prompt", recipe.system),
                                     (f"{len(recipe.parameters)} parameter(s)",
                                      recipe.parameters)) if there]
    said = "; ".join([f"{how}, {human_size(model.model.size)}", *kept, *notes])
    return f"imported {name} ({said})"


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
        except UserError as e:
            if wanted:
                raise
            print(f"skipped {name}: {e}")
    return 0
