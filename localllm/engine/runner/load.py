"""One load decision: how a model is loaded, settled once (daemon/planner.py) before its runner
starts, as one frozen value: the plan (its speculative mode settled, with the draft model's
file), the fill bands beside it and the one the runner starts in, the RAM for its prompt cache,
the files. Nothing in it says "auto": the runner is started from this value alone (it crosses
the runner's pipe as the op table's `load`, `to_wire` / `from_wire`, and is rebuilt there as the
same dataclass), and a later request is served by the same load while `Load.serves` says so.

Light on purpose: the runner imports it before llama.cpp, which must load before numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from localllm.planner.plan import Plan

from localllm.options import LoadOptions
from localllm.speculative import mode as mode_row


@dataclass(frozen=True)
class Load:
    """A model's load, decided: what the runner starts with and what a request must match."""

    plan: Plan  # the whole context's plan, its speculative mode settled
    asked: LoadOptions = LoadOptions()  # the load options the plan was made for
    bands: tuple[Plan, ...] = ()  # plans for smaller contexts, smallest first (fill bands)
    start_band: int = 0  # the band the runner starts in (len(bands): the whole plan)
    draft_path: Path | None = None  # the draft model's file, when the plan drafts with one
    draft_name: str = ""  # what options.draft_model must equal to reuse this load
    projector: Path | None = None  # a vision model's projector file
    prompt_cache_bytes: int = 0  # the RAM the runner may keep prompts of taken slots in
    model_path: Path | None = None  # the model's file
    # A vision model's image tokens (0: none): the plan's micro-batch holds one image's
    # (planner.vision.with_room_for_images), a smaller plan's too
    image_tokens: int = 0
    # The prompt cache on disk (engine/runner/disk_cache.py): its folder (None: none) and the
    # bytes all its files may hold (setting prompt_cache_disk)
    prompt_disk_dir: Path | None = None
    prompt_disk_bytes: int = 0

    def starts_same_runner(self, other: Load) -> bool:
        """Whether `other` starts the very runner this load does (its plan's and fill bands'
        load keys): a re-plan that gives such a load changes prices, not what runs."""
        return [p.load_key() for p in (self.plan, *self.bands)] == \
            [p.load_key() for p in (other.plan, *other.bands)]

    def serves(self, running: Plan, asked: LoadOptions) -> bool:
        """Whether this load, running `running` (its plan, or the smaller one a failed load
        stepped down to), serves a request's load options as it is (Ollama's needsReload, over
        typed values). Options left to the tuner are None and never reload; a value the
        planner changed (a num_ctx past the trained context, capped) matches the load it asked
        for, so asking again does not reload either."""
        planned = {"num_ctx": running.n_ctx, "num_gpu": running.n_gpu_layers,
                   "num_thread": running.n_threads, "num_batch": running.n_batch}
        for name, value in asked.given().items():
            if name in planned and value not in (planned[name], getattr(self.asked, name)):
                return False
        if asked.speculative is None and asked.draft_model is None:
            return True  # no drafter asked for: whichever this load has serves
        return not differs(self.plan.speculative, self.draft_name, asked)

    def to_wire(self) -> dict:
        """The load as the runner's `load` op (runner/protocol.py's OPS): one JSON object."""
        def path(p: Path | None) -> str | None:
            return str(p) if p is not None else None

        return {"op": "load", "id": "", "plan": self.plan.to_dict(), "asked": self.asked.given(),
                "bands": [b.to_dict() for b in self.bands], "start_band": self.start_band,
                "draft_path": path(self.draft_path), "draft_name": self.draft_name,
                "projector": path(self.projector),
                "prompt_cache_bytes": self.prompt_cache_bytes,
                "model_path": path(self.model_path), "image_tokens": self.image_tokens,
                "prompt_disk_dir": path(self.prompt_disk_dir),
                "prompt_disk_bytes": self.prompt_disk_bytes}

    @classmethod
    def from_wire(cls, data: dict) -> Load:
        def path(value) -> Path | None:
            return Path(value) if value else None

        return cls(Plan.from_dict(data["plan"]), LoadOptions(**data.get("asked") or {}),
                   tuple(Plan.from_dict(b) for b in data.get("bands") or ()),
                   int(data.get("start_band") or 0), path(data.get("draft_path")),
                   str(data.get("draft_name") or ""), path(data.get("projector")),
                   int(data.get("prompt_cache_bytes") or 0), path(data.get("model_path")),
                   int(data.get("image_tokens") or 0), path(data.get("prompt_disk_dir")),
                   int(data.get("prompt_disk_bytes") or 0))


def differs(speculative: str, draft_name: str, load: LoadOptions) -> bool:
    """Whether a request's speculation load options need another load than one drafting with
    `speculative` and the draft model `draft_name` ("": the catalog's pairing, or none)."""
    if load.speculative is not None and load.speculative != speculative:
        return True
    if load.speculative is not None and mode_row(load.speculative).draft_model \
            and load.draft_model is None and draft_name:
        return True  # a draft model asked alone means the model's own pairing, not one named
    return load.draft_model is not None and load.draft_model != draft_name
