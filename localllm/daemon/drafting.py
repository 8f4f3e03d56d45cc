"""Speculative decoding at load time: which drafter a runner loads, and the draft model's file.

Prompt lookup needs nothing loaded, so any request may ask for it. MTP needs the model's NextN
layers loaded and a context of their own; a draft model needs its own weights and context: a
request asking for a mode whose drafter loads with the model (localllm.speculative: Mode.loaded)
loads the model with it, as Ollama reloads for a new num_ctx. The draft model is
`options.draft_model` (a stored model's name), else the catalog's pairing (the `draft` layer
pulled with the model). What each mode needs is its row's, never its name's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from localllm.errors import UserError
from localllm.modelstore.pull import find_stored, model_file
from localllm.modelstore.shape import ModelShape
from localllm.modelstore.store import DRAFT_LAYER, ModelEntry, ModelNotFound, ModelStore
from localllm.options import LoadOptions
from localllm.planner.plan import Plan
from localllm.speculative import VOCAB_SLACK
from localllm.speculative import mode as mode_row


ALL_LAYERS = 999


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
    plan is needed for it, so the scheduler asks once, before it unloads anything."""
    if load.speculative is None:
        return
    asked = mode_row(load.speculative)
    if asked.draft_model and draft_shape is not None and \
            abs(draft_shape.n_vocab - shape.n_vocab) > VOCAB_SLACK:
        raise UserError(f"{draft.name or 'the paired draft model'} cannot draft for "
                        f"{entry.name}: its vocabulary has {draft_shape.n_vocab} tokens, "
                        f"the model's {shape.n_vocab}")
    if asked.nextn and shape.n_nextn == 0:
        raise UserError(f"{entry.name} has no MTP layers (nextn_predict_layers is 0); use "
                        f"speculative 'lookup' or 'draft'")
    if asked.draft_model and draft.path is None:
        raise UserError(f"{entry.name} has no draft model paired with it; name one with "
                        f"options.draft_model (a model with the same vocabulary)")


def with_speculation(entry: ModelEntry, shape: ModelShape, plan: Plan, load: LoadOptions,
                     draft: DraftChoice, draft_shape: ModelShape | None = None
                     ) -> tuple[Plan, Path | None]:
    """The plan with the speculative mode the request asks for (else the plan's own), and the
    draft model's file to load with it (None unless the mode drafts with one). The request
    was checked already (check_speculation): a mode that cannot load here falls back to off."""
    asked = load.speculative  # a mode loaded with the model (localllm/options.py), else None
    mode = asked or plan.speculative
    row = mode_row(mode)
    name, path = draft.name, draft.path  # path dropped below when it cannot draft
    if draft_shape is not None and abs(draft_shape.n_vocab - shape.n_vocab) > VOCAB_SLACK:
        path = None
    if row.nextn and shape.n_nextn == 0 or row.draft_model and path is None:
        mode, row = "off", mode_row("off")
    path = path if row.draft_model else None
    if mode == plan.speculative and not asked:
        return plan, path
    changes: dict = {"speculative": mode}
    said = f"speculative {mode}" + (f" with draft model {name}" if row.draft_model else "")
    if row.draft_model and not plan.draft_n_gpu_layers and plan.n_gpu_layers > 0:
        changes["draft_n_gpu_layers"] = ALL_LAYERS
    reason = (f"{said}, from the request's options" if asked
              else f"{said}: the plan's choice could not be loaded")
    return replace(plan, **changes, reasons=(*plan.reasons, reason)), path
