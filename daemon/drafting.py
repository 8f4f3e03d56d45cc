"""Speculative decoding at load time: which drafter a runner loads, and the draft model's file.

Prompt lookup needs nothing loaded, so any request may ask for it. MTP needs the model's NextN
layers loaded and a context of their own; a draft model needs its own weights and context: a
request asking for either (`options.speculative` "mtp" or "draft") loads the model with it, as
Ollama reloads for a new num_ctx. The draft model is `options.draft_model` (a stored model's
name), else the catalog's pairing (the `draft` layer pulled with the model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from localllm.errors import UserError
from localllm.modelstore.pull import find_stored, model_file
from localllm.modelstore.shape import ModelShape
from localllm.modelstore.store import DRAFT_LAYER, ModelEntry, ModelNotFound, ModelStore
from localllm.options import LoadOptions
from localllm.profiles.planning.plan import Plan

from .runner.protocol import VOCAB_SLACK

ALL_LAYERS = 999


@dataclass(frozen=True)
class Speculation:
    """How a load drafts: its plan (with the mode) and the draft model it was loaded with. One
    request's drafting, inside the runner, is runner/speculation.Drafting."""

    plan: Plan
    draft_path: Path | None = None
    draft_name: str = ""  # what options.draft_model must equal to reuse this load


def differs(loaded: Speculation, load: LoadOptions) -> bool:
    """Whether a request's speculation load options need another load than `loaded`."""
    if load.speculative is not None and load.speculative != loaded.plan.speculative:
        return True
    if load.speculative == "draft" and load.draft_model is None and loaded.draft_name:
        return True  # "draft" alone means the model's own pairing, not one a request named
    return load.draft_model is not None and load.draft_model != loaded.draft_name


@dataclass(frozen=True)
class DraftChoice:
    name: str = ""  # as options.draft_model named it ("" for the catalog's pairing)
    path: Path | None = None


def draft_model(store: ModelStore, entry: ModelEntry, load: LoadOptions) -> DraftChoice:
    """The draft model for `entry`: options.draft_model, else the catalog's pairing, else none.
    Raises ModelNotFound for a named draft model that is not stored."""
    asked = load.draft_model
    if asked:
        draft = find_stored(store, asked)
        if draft is None or draft.model_path is None:
            raise ModelNotFound(f"draft model '{asked}' not found; pull it first "
                                f"(`localllm pull {asked}`)")
        return DraftChoice(asked, model_file(store, draft))
    layer = entry.companion(DRAFT_LAYER)
    return DraftChoice("", store.blob_path(layer.digest)) if layer else DraftChoice()


def check_speculation(entry: ModelEntry, shape: ModelShape, load: LoadOptions,
                      draft: DraftChoice, draft_shape: ModelShape | None = None) -> None:
    """Raise UserError for a speculative mode the request asks that this model cannot do; no
    plan is needed for it, so the scheduler asks before it unloads anything."""
    asked = load.speculative
    if asked == "draft" and draft_shape is not None and \
            abs(draft_shape.n_vocab - shape.n_vocab) > VOCAB_SLACK:
        raise UserError(f"{draft.name or 'the paired draft model'} cannot draft for "
                        f"{entry.name}: its vocabulary has {draft_shape.n_vocab} tokens, "
                        f"the model's {shape.n_vocab}")
    if asked == "mtp" and shape.n_nextn == 0:
        raise UserError(f"{entry.name} has no MTP layers (nextn_predict_layers is 0); use "
                        f"speculative 'lookup' or 'draft'")
    if asked == "draft" and draft.path is None:
        raise UserError(f"{entry.name} has no draft model paired with it; name one with "
                        f"options.draft_model (a model with the same vocabulary)")


def with_speculation(entry: ModelEntry, shape: ModelShape, plan: Plan, load: LoadOptions,
                     draft: DraftChoice, draft_shape: ModelShape | None = None) -> Speculation:
    """The plan with the speculative mode the request asks for (else the plan's own), and the
    draft model to load with it. Raises UserError for what cannot be done."""
    check_speculation(entry, shape, load, draft, draft_shape)
    asked = load.speculative  # "mtp" or "draft" (localllm/options.py), else None
    mode = asked or plan.speculative
    name, path = draft.name, draft.path  # path dropped below when it cannot draft
    if draft_shape is not None and abs(draft_shape.n_vocab - shape.n_vocab) > VOCAB_SLACK:
        path = None
    if mode == "mtp" and shape.n_nextn == 0:
        mode = "off"
    if mode == "draft" and path is None:
        mode = "off"
    if mode == plan.speculative and not asked:
        return Speculation(plan, path if mode == "draft" else None, name)
    changes: dict = {"speculative": mode}
    said = f"speculative {mode}" + (f" with draft model {name}" if mode == "draft" else "")
    if mode == "draft" and not plan.draft_n_gpu_layers and plan.n_gpu_layers > 0:
        changes["draft_n_gpu_layers"] = ALL_LAYERS
    reason = (f"{said}, from the request's options" if asked
              else f"{said}: the plan's choice could not be loaded")
    plan = replace(plan, **changes, reasons=(*plan.reasons, reason))
    return Speculation(plan, path if mode == "draft" else None, name)
