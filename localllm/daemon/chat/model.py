"""What the chat layer needs to know about a model, read from its GGUF header once per digest:
the chat template, the BOS/EOS pieces it is rendered with, the fill-in-the-middle markers, how
it pools embeddings, and from all of that the capabilities that /api/show reports.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from pathlib import Path

from localllm.modelstore.gguf_header import GGUFError, read_header, read_token_pieces
from localllm.modelstore.custom import Customization
from localllm.modelstore.store import PROJECTOR_LAYER, DamagedModel, ModelEntry

from .template import TemplateStyle, template_style

# llama.cpp's enum llama_pooling_type: a reranker's (it scores pairs, makes no embeddings)
RANK_POOLING = 4

@dataclass(frozen=True)
class FimTokens:
    prefix: str
    suffix: str
    middle: str


@dataclass(frozen=True)
class ChatModel:
    architecture: str
    template: str | None
    bos: str
    eos: str
    eot: str  # end-of-turn piece where it differs from EOS (Llama 3's <|eot_id|>), else ""
    fim: FimTokens | None
    pooling_type: int | None  # None: the GGUF does not say (a causal LM: mean pooling)
    has_vision: bool
    style: TemplateStyle
    context_length: int
    info: dict  # the header's general.* and <arch>.* keys: /api/show's model_info

    @property
    def capabilities(self) -> list[str]:
        """Ollama's capability names, in Ollama's order."""
        caps = []
        if self.ranks:
            caps.append("rerank")
        elif self.pooling_type not in (None, 0):
            caps.append("embedding")
        else:
            caps.append("completion")
        if self.has_vision:
            caps.append("vision")
        if self.style.tools:
            caps.append("tools")
        if self.fim is not None:
            caps.append("insert")
        if self.style.thinking:
            caps.append("thinking")
        return caps

    @property
    def ranks(self) -> bool:
        """A reranker: /v1/rerank scores documents with it."""
        return self.pooling_type == RANK_POOLING

    def with_template(self, template: str) -> ChatModel:
        """The model rendered with another chat template (a Modelfile's TEMPLATE)."""
        return replace(self, template=template, style=template_style(template, self.architecture))

    @property
    def stop_pieces(self) -> list[str]:
        """The end-of-turn markers the template writes: Ollama's `stop` parameters."""
        stops = [p for p in (self.eot, self.eos) if p]
        stops += [s for s in self.style.stops if s not in stops]
        return stops


def read_chat_model(path: str | Path) -> ChatModel:
    """Blocking (reads the file): call it through `chat_model` from the event loop."""
    header = read_header(path)
    md = header.metadata
    arch = str(md.get("general.architecture", ""))

    def token_id(*keys: str) -> int | None:
        for key in keys:
            value = md.get(f"tokenizer.ggml.{key}")
            if isinstance(value, int) and value >= 0:
                return value
        return None

    ids = {
        "bos": token_id("bos_token_id"),
        "eos": token_id("eos_token_id"),
        "eot": token_id("eot_token_id"),
        "pre": token_id("fim_pre_token_id", "prefix_token_id"),
        "suf": token_id("fim_suf_token_id", "suffix_token_id"),
        "mid": token_id("fim_mid_token_id", "middle_token_id"),
    }
    pieces = read_token_pieces(path, {i for i in ids.values() if i is not None})
    piece = {name: pieces.get(i, "") if i is not None else "" for name, i in ids.items()}
    fim = None
    if piece["pre"] and piece["suf"] and piece["mid"]:
        fim = FimTokens(piece["pre"], piece["suf"], piece["mid"])
    template = md.get("tokenizer.chat_template")
    template = template if isinstance(template, str) and template.strip() else None
    pooling = md.get(f"{arch}.pooling_type")
    eot = piece["eot"] if piece["eot"] != piece["eos"] else ""
    return ChatModel(
        architecture=arch,
        template=template,
        bos=piece["bos"],
        eos=piece["eos"],
        eot=eot,
        fim=fim,
        pooling_type=pooling if isinstance(pooling, int) else None,
        has_vision=any(k.endswith("vision.block_count") for k in md),
        style=template_style(template, arch),
        context_length=int(md.get(f"{arch}.context_length") or 0),
        # Ollama's model_info carries general.parameter_count (clients size models by it); a
        # GGUF seldom writes it, its tensors always tell it
        info={"general.parameter_count": sum(t.n_elements for t in header.tensors),
              **{k: v for k, v in md.items()
                 if v is not None and (k.startswith("general.") or k.startswith(f"{arch}."))}},
    )


_cache: dict[str, ChatModel] = {}


async def chat_model(digest: str, path: str | Path) -> ChatModel:
    """The model's ChatModel, read off the event loop once per blob digest."""
    found = _cache.get(digest)
    if found is None:
        found = await asyncio.to_thread(read_chat_model, path)
        _cache[digest] = found
    return found


async def model_for(entry: ModelEntry, template: str | None = None) -> ChatModel:
    """The model as a request sees it: with `template` (a Modelfile's TEMPLATE) in place of the
    GGUF's when given; it takes images only when stored with a vision projector (the manifest's
    projector layer)."""
    try:
        model = await chat_model(entry.digest, entry.model_path)
    except (GGUFError, OSError) as e:
        raise DamagedModel(entry.name, str(e).replace(str(entry.model_path), "its blob")) \
            from None
    model = replace(model, has_vision=entry.companion(PROJECTOR_LAYER) is not None)
    return model.with_template(template) if template else model


def capabilities(model: ChatModel, custom: Customization) -> list[str]:
    """/api/show's capabilities: the model's, with a Modelfile TEMPLATE in place of the GGUF's."""
    return (model.with_template(custom.template) if custom.template else model).capabilities
