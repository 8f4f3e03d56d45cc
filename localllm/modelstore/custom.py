"""What a Modelfile adds to a model (/api/create, modelfile.py): default parameters, a chat
template, a system prompt. Each is a small blob in the model's manifest beside the GGUF, so
`copy` and `rm` treat it like any other layer, and requests read it back here.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from localllm.errors import UserError
from localllm import options
from localllm.options import OPTIONS

from .store import Layer, ModelEntry, ModelStore, no_room_is_disk_full

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
                         "logits_all", "vocab_only", "use_mlock", "embedding_only", "main_gpu",
                         "rope_frequency_base", "rope_frequency_scale"})
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


# `ollama show --modelfile` writes Ollama's own Go template: a Modelfile that carries one is
# taken, with the GGUF's chat template in its place (the model was trained on that one)
GO_TEMPLATE_NOTE = "Ollama's Go template left out: the GGUF's own chat template is used"


def is_go_template(template: str) -> bool:
    return bool(re.search(r"\{\{-?\s*\.", template))


def check_template(template: str) -> str:
    if is_go_template(template):
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
