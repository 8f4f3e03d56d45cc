"""A Modelfile read into a `Recipe` and built into the store: `/api/create`, `localllm create`
and the CLI's import from Ollama share it. What it adds to a model is stored and read back by
custom.py.

    FROM <model name | sha256:<digest> of an uploaded blob | /path/to/file.gguf>
    PARAMETER <name> <value>        (repeat `stop` for several)
    TEMPLATE \"\"\"<Jinja chat template>\"\"\"
    SYSTEM \"\"\"<system prompt>\"\"\"
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .custom import (
    CUSTOM_LAYERS,
    LICENSE_LAYER,
    MESSAGE_ROLES,
    MESSAGES_LAYER,
    OLLAMA_ONLY,
    PARAMS_LAYER,
    SYSTEM_LAYER,
    TEMPLATE_LAYER,
    GO_TEMPLATE_NOTE,
    ModelfileError,
    check_template,
    is_go_template,
    parameter_value,
    text_layer,
)
from .gguf_header import GGUFError, read_header
from .names import parse_name
from .shape import shape_from_header
from .store import (
    MODEL_LAYER,
    Layer,
    ModelStore,
    StoreError,
    model_details,
)

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
            take_template(recipe, rest)
        elif command == "SYSTEM":
            recipe.system = rest
        else:
            raise ModelfileError(f"{command} is not supported; localllm's Modelfile takes FROM, "
                                 f"PARAMETER, TEMPLATE, SYSTEM, MESSAGE and LICENSE")
    return recipe


def take_template(recipe: Recipe, template: str) -> None:
    """A Jinja TEMPLATE replaces the GGUF's; Ollama's Go template is left out with a note."""
    if is_go_template(template):
        if GO_TEMPLATE_NOTE not in recipe.notes:
            recipe.notes.append(GO_TEMPLATE_NOTE)
        return
    recipe.template = check_template(template)


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
