"""Speculative decoding's modes in one table: what each drafts from and what it needs loaded.

A request's `speculative` option, a plan's mode, a saved profile, the scheduler's load decision,
llama.cpp's parameters, the runner and the TUI read a mode's row here, never its name; a new mode
is a row here, its drafter (engine/drafters.py) and its pricing (planner/speculation.py).
The rules a plan derives from its row (the longest draft, the recurrent-state snapshots) are
methods of the Plan (planner/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

# The longest draft the runner checks in one pass.
MAX_DRAFT = 8


def logit_rows(n_seq: int) -> int:
    """The most rows of one llama_decode on the model's own context that ask for logits: each
    slot's next token with its longest draft (a slot reading its prompt asks for one row). The
    context is created to hold this many (llama.cpp's n_outputs_max): its default, n_batch,
    reserves n_vocab f32 logits for every row of a micro-batch in the compute buffer and on the
    host, 1.2 GiB for a 152K vocabulary at n_ubatch 2048, used only by a prompt read whole
    with logprobs, which the runner reads in chunks of this many rows instead."""
    return n_seq * (1 + MAX_DRAFT)
# A draft model's vocabulary may have this many more or fewer tokens than the model's (llama.cpp's
# speculative example allows as much); the ids they share must mean the same text.
VOCAB_SLACK = 128
AUTO = "auto"  # a request's "the plan's choice"; the daemon resolves it before the runner


@dataclass(frozen=True)
class Mode:
    name: str
    help: str
    drafts: bool = True  # proposes drafts at all ("off" does not)
    # Its drafter is loaded with the model: a request asking for it reloads the model (as a
    # new num_ctx does), and a load with it has no fill bands (the drafter is bound to the
    # loaded model). The others draft from the text alone.
    loaded: bool = False
    nextn: bool = False  # needs the model's NextN layers (llama.cpp's load_mtp)
    draft_model: bool = False  # needs a draft model with the target's vocabulary
    # The longest draft where the plan leaves draft_n_max at 0. MTP's chained passes lose
    # acceptance fast after a few, so its default is short and the plan's length binds every
    # request; the others adapt up to MAX_DRAFT at the acceptance measured.
    default_draft: int = MAX_DRAFT
    plan_bounds_length: bool = False
    # Prompts of taken slots may be kept in RAM (the prompt cache, engine/runner/reuse.py); not
    # with MTP, whose own cache of each sequence would have to be saved and restored beside the
    # target's.
    prompt_cache: bool = True


MODES = (
    Mode("off", "no drafting", drafts=False, default_draft=0),
    Mode("lookup", "n-grams of the prompt and the answer"),
    Mode("mtp", "the model's NextN layers", loaded=True, nextn=True, default_draft=3,
         plan_bounds_length=True, prompt_cache=False),
    Mode("draft", "a draft model with the same vocabulary", loaded=True, draft_model=True),
)
BY_NAME = {m.name: m for m in MODES}
SPECULATIVE_MODES = tuple(BY_NAME)  # what a plan may say
SPECULATIVE_CHOICES = (AUTO, *SPECULATIVE_MODES)  # what a request may say
LOAD_MODES = tuple(m.name for m in MODES if m.loaded)  # a request asking these reloads
DRAFTING_MODES = tuple(m.name for m in MODES if m.drafts)  # acceptance is measured for these
# Names profiles saved before "lookup", and before plans and requests shared one vocabulary.
ALIASES = {"prompt-lookup": "lookup", "none": "off"}


class UnknownMode(ValueError):
    pass


def current_name(name: str) -> str:
    """A mode under its current name (an unknown name is left for the caller to refuse)."""
    return ALIASES.get(name, name)


def mode(name: str) -> Mode:
    """The row of a mode (under its current name); UnknownMode names the modes there are."""
    row = BY_NAME.get(current_name(name))
    if row is None:
        raise UnknownMode(f"unknown speculative mode {name!r}; use "
                          f"{', '.join(SPECULATIVE_MODES)}")
    return row
