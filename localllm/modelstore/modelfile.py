"""A Modelfile, read and built into the store (`/api/create`, `localllm create`, and the CLI's
import from Ollama share it), and what it adds to a model: default parameters, a chat template,
a system prompt, MESSAGE lines, a license. Each addition is a small blob in the model's manifest
beside the GGUF, so `copy` and `rm` treat it like any other layer, and requests read it back
here (`read_customization`).

    FROM <model name | sha256:<digest> of an uploaded blob | /path/to/file.gguf>
    PARAMETER <name> <value>        (repeat `stop` for several)
    TEMPLATE \"\"\"<Jinja chat template>\"\"\"
    SYSTEM \"\"\"<system prompt>\"\"\"
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from localllm import options
from localllm.errors import UserError
from localllm.options import OPTIONS

from .gguf_header import GGUFError, read_header
from .names import parse_name
from .shape import shape_from_header
from .store import (
    MODEL_LAYER,
    Layer,
    ModelEntry,
    ModelStore,
    StoreError,
    model_details,
    no_room_is_disk_full,
)

PARAMS_LAYER = "application/vnd.localllm.params"
TEMPLATE_LAYER = "application/vnd.localllm.template"
SYSTEM_LAYER = "application/vnd.localllm.system"
MESSAGES_LAYER = "application/vnd.localllm.messages"  # a Modelfile's MESSAGE lines, JSON
LICENSE_LAYER = "application/vnd.localllm.license"
CUSTOM_LAYERS = (PARAMS_LAYER, TEMPLATE_LAYER, SYSTEM_LAYER, MESSAGES_LAYER, LICENSE_LAYER)
# Ollama's PARAMETERs that this engine has no use for: a Modelfile or an Ollama model with them
# is taken, and each is left out with a note (`import --from-ollama` says the same)
OLLAMA_ONLY = frozenset({"num_keep", "mirostat", "mirostat_eta", "mirostat_tau", "tfs_z",
                         "penalize_newline", "num_gqa", "numa", "low_vram", "f16_kv",
                         "logits_all", "vocab_only", "use_mlock", "embedding_only", "num_gpu",
                         "main_gpu", "rope_frequency_base", "rope_frequency_scale"})
MESSAGE_ROLES = ("system", "user", "assistant")

class ModelfileError(UserError, ValueError):
    """A Modelfile line or create field localllm cannot take (400; the message says which)."""


@dataclass(frozen=True)
class Customization:
    parameters: dict = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    messages: tuple[dict, ...] = ()  # MESSAGE lines: sent before the conversation, as Ollama
    license: str | None = None


def parameter_value(key: str, value):
    """A PARAMETER's value in its type (Modelfile text or JSON from /api/create), checked by the
    one option table; `stop` gives one string (a Modelfile repeats the line for more)."""
    if key not in OPTIONS:
        raise ModelfileError(f"unknown PARAMETER {key!r}; localllm takes "
                             f"{', '.join(sorted(OPTIONS))}")
    try:
        if key == "stop":
            if not isinstance(value, str):
                raise options.OptionError("stop must be a string", key)
            return value.strip('"') if value.startswith('"') else value
        if isinstance(value, str):
            return options.from_text(key, value)
        return options.check(key, value)
    except options.OptionError as e:
        raise ModelfileError(str(e)) from None


def check_template(template: str) -> str:
    if re.search(r"\{\{-?\s*\.", template):
        raise ModelfileError("TEMPLATE is a Go template; localllm renders Jinja (Hugging Face) "
                             "chat templates: give one with `messages`, as in the GGUF")
    return template


def read_customization(store: ModelStore, entry: ModelEntry) -> Customization:
    """Blocking (reads blobs): call it off the event loop."""
    def text(media_type: str) -> str | None:
        layer = entry.companion(media_type)
        return store.blob_path(layer.digest).read_text() if layer else None

    params = text(PARAMS_LAYER)
    messages = text(MESSAGES_LAYER)
    return Customization(parameters=json.loads(params) if params else {},
                         template=text(TEMPLATE_LAYER), system=text(SYSTEM_LAYER),
                         messages=tuple(json.loads(messages)) if messages else (),
                         license=text(LICENSE_LAYER))


def text_layer(store: ModelStore, media_type: str, text: str) -> Layer:
    """Store `text` as a blob and return its manifest layer."""
    data = text.encode()
    hexdigest = hashlib.sha256(data).hexdigest()
    digest = f"sha256:{hexdigest}"
    if not store.has_blob(digest):
        with no_room_is_disk_full(f"storing the model's {media_type.rpartition('.')[2]}"):
            staged = store.staging_file("text-")
            try:
                staged.write_bytes(data)
                store.publish_blob(staged, hexdigest)
            finally:
                staged.unlink(missing_ok=True)
    return Layer(media_type, digest, len(data))


BLOB_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


@dataclass
class Recipe:
    base: str = ""  # model name, blob digest or file path
    parameters: dict = field(default_factory=dict)
    template: str | None = None
    system: str | None = None
    layers: tuple[Layer, ...] = ()  # stored blobs added as they are (an import's projector)
    messages: list[dict] = field(default_factory=list)  # MESSAGE lines
    license: str | None = None
    notes: list[str] = field(default_factory=list)  # what was taken but left out, said once


def parse_modelfile(text: str) -> Recipe:
    recipe = Recipe()
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        command, _, rest = line.partition(" ")
        command, rest = command.upper(), rest.strip()
        role = ""
        if command == "MESSAGE":
            role, _, rest = rest.partition(" ")
            role, rest = role.lower(), rest.strip()
            if role not in MESSAGE_ROLES:
                raise ModelfileError(f"MESSAGE takes a role of {', '.join(MESSAGE_ROLES)}, "
                                     f"not {role!r}")
        if command in ("TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE") and rest.startswith('"""'):
            rest, i = _quoted_block(command, rest[3:], lines, i)
        elif command in ("TEMPLATE", "SYSTEM", "MESSAGE", "LICENSE") and len(rest) > 1 \
                and rest[0] == rest[-1] == '"':
            rest = rest[1:-1]
        if command == "FROM":
            recipe.base = rest
        elif command == "PARAMETER":
            key, _, value = rest.partition(" ")
            key = key.strip()
            if key in OLLAMA_ONLY:
                recipe.notes.append(f"parameter {key} left out (localllm has no such option)")
                continue
            value = parameter_value(key, value.strip())
            if key == "stop":
                recipe.parameters.setdefault("stop", []).append(value)
            else:
                recipe.parameters[key] = value
        elif command == "MESSAGE":
            recipe.messages.append({"role": role, "content": rest})
        elif command == "LICENSE":
            recipe.license = rest if recipe.license is None else f"{recipe.license}\n\n{rest}"
        elif command == "ADAPTER":
            raise ModelfileError("ADAPTER is not supported: localllm serves GGUF models without "
                                 "LoRA adapters; merge the adapter into the model first")
        elif command == "REQUIRES":
            raise ModelfileError("REQUIRES names an Ollama version; localllm cannot promise "
                                 "what a given Ollama version does: remove the line")
        elif command == "TEMPLATE":
            recipe.template = check_template(rest)
        elif command == "SYSTEM":
            recipe.system = rest
        else:
            raise ModelfileError(f"{command} is not supported; localllm's Modelfile takes FROM, "
                                 f"PARAMETER, TEMPLATE, SYSTEM, MESSAGE and LICENSE")
    return recipe


def _quoted_block(command: str, first: str, lines: list[str], i: int) -> tuple[str, int]:
    """The text of a \"\"\" block that opened with `first` on its line, and the index of the
    line after it; one pass over the lines (an unclosed block is an error, not a rescan)."""
    if '"""' in first:
        return first[: first.index('"""')], i
    parts = [first]
    for j in range(i, len(lines)):
        if '"""' in lines[j]:
            parts.append(lines[j][: lines[j].index('"""')])
            return "\n".join(parts), j + 1
        parts.append(lines[j])
    raise ModelfileError(f'{command} opens """ but never closes it')


def _gguf_layer(store: ModelStore, digest: str) -> tuple[Layer, dict]:
    path = store.blob_path(digest)
    if not path.is_file():
        raise StoreError(f"blob {digest} is not in the store; upload it with POST "
                         f"/api/blobs/{digest} first")
    try:
        shape = shape_from_header(read_header(path), str(path))
    except GGUFError as e:
        raise StoreError(f"blob {digest} is not a GGUF model: {e}") from None
    return Layer(MODEL_LAYER, digest, path.stat().st_size), model_details(shape)


def is_path(base: str) -> bool:
    """Whether FROM names a file rather than a model or a blob."""
    return base.startswith(("/", "~", "./", "../"))


def build(store: ModelStore, name: str, recipe: Recipe) -> None:
    """Blocking (hashes and writes files): run it off the event loop."""
    target = parse_name(name)
    match = BLOB_DIGEST.match(recipe.base)
    if match:
        layer, details = _gguf_layer(store, f"sha256:{match.group(1)}")
        layers, source = [layer], f"create:{recipe.base}"
    elif is_path(recipe.base):
        path = Path(recipe.base).expanduser()
        entry = store.import_gguf(path, name)  # names the GGUF; the custom layers follow
        layers, details, source = list(entry.layers), entry.details, entry.source
    else:
        base = store.get(recipe.base)
        layers = list(base.layers)
        details, source = base.details, f"create:{base.name}"
    # A Modelfile's additions replace the base's, and inherit those it does not set.
    inherited = {layer.media_type: layer for layer in layers if layer.media_type in CUSTOM_LAYERS}
    layers = [layer for layer in layers if layer.media_type not in CUSTOM_LAYERS]
    if recipe.parameters:
        old = {}
        if PARAMS_LAYER in inherited:
            old = json.loads(store.blob_path(inherited[PARAMS_LAYER].digest).read_text())
        inherited[PARAMS_LAYER] = text_layer(store, PARAMS_LAYER,
                                             json.dumps({**old, **recipe.parameters}))
    if recipe.template is not None:
        inherited[TEMPLATE_LAYER] = text_layer(store, TEMPLATE_LAYER, recipe.template)
    if recipe.system is not None:
        inherited[SYSTEM_LAYER] = text_layer(store, SYSTEM_LAYER, recipe.system)
    if recipe.messages:
        inherited[MESSAGES_LAYER] = text_layer(store, MESSAGES_LAYER, json.dumps(recipe.messages))
    if recipe.license is not None:
        inherited[LICENSE_LAYER] = text_layer(store, LICENSE_LAYER, recipe.license)
    store.write_manifest(target, layers + list(inherited.values()) + list(recipe.layers),
                         details, source)
