"""How a load is decided: the scheduler hands the planner what a request asks of the model
(its load options), the daemon's live `Config` and the model; `Planner.decide` makes the one
planning call and returns the frozen `Load` (engine/runner/load.py) the runner is started
from. Every rule of a load is applied here, once: the speculative mode settled, the fill bands
(none with a projector, a draft model or MTP: profiles/bands.py), the images' micro-batch, the
prompt cache's RAM and its folder on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localllm.engine.runner.load import Load
from localllm.modelstore.shape import ModelShape
from localllm.modelstore.store import ModelEntry
from localllm.planner.plan import Plan
from localllm.planner.vision import with_room_for_images

from localllm import paths
from localllm.config import Config
from localllm.options import LoadOptions

from .drafting import DraftChoice, with_speculation

PROMPT_CACHE_AUTO_MAX = 8 * 2**30
CHARS_PER_TOKEN = 3  # few texts take fewer characters a token: a prompt is not underrated


class Planner:
    """How the scheduler gets plans: `decide`, the one planning call of a load, made of the
    tuner's `choose_plan` and fill `bands`; and `step_down` after a load ran out of memory.
    Tests may pass a subclass with other plans. `live` gives the scheduler's live Config, which
    the tuner plans under (without one it reads config.toml, as `tune` does)."""

    live: Callable[[], Config] | None = None

    def __init__(self, live: Callable[[], Config] | None = None):
        self.live = live

    def config(self) -> Config | None:
        return self.live() if self.live else None

    def decide(self, config: Config, entry: ModelEntry, shape: ModelShape, asked: LoadOptions,
               draft: DraftChoice, draft_shape: ModelShape | None = None,
               projector: Path | None = None, hint: str | None = None,
               prompt_chars: int = 0) -> Load:
        """The load of `entry` for a request asking `asked` (checked already: drafting's
        check_speculation) whose prompt is `prompt_chars` characters, under `config`. Probes
        the GPU and may dry-run llama.cpp: seconds, so the scheduler calls it off the event
        loop."""
        name = entry.name.tagged
        vision = {}  # (a planner without projectors is asked as before)
        if projector is not None:
            from localllm.modelstore.projector import projector_info

            vision["projector"] = projector_info(projector)
        plan = self.choose(shape, name, context_to_ask(config, asked.num_ctx, shape), asked,
                           draft_shape, hint=hint, **vision)
        plan, draft_path = with_speculation(entry, shape, plan, asked, draft, draft_shape)
        bands, image_tokens = (), 0
        if projector is None:
            # The whole context's plan beside bands is planned for the prompt that enters it
            # (profiles.bands), not the short ones the first band serves.
            bands, plan = self.bands(shape, name, asked, plan, config.fill_bands, hint)
        else:  # no bands: the projector is bound to the loaded model
            image_tokens = vision["projector"].tokens_per_image or 0
            plan = with_room_for_images(plan, image_tokens)
        return Load(plan, asked, bands, first_band(bands, prompt_chars), draft_path,
                    draft.name, projector, prompt_cache_bytes(config), entry.model_path,
                    image_tokens, *prompt_disk(config))

    def choose(self, shape: ModelShape, model_name: str, n_ctx: int | None,
               load: LoadOptions, draft_shape: ModelShape | None = None,
               projector=None, hint: str | None = None) -> Plan:
        """`projector`: a vision model's ProjectorInfo, planned on the card with the model
        (planner.vision). `hint`: what the loading request's route says of its session."""
        from localllm.profiles.choose import choose_plan

        card = self.card()
        if projector is None:
            return choose_plan(shape, model_name, n_ctx, load, card, draft_shape=draft_shape,
                               hint=hint, config=self.config())
        from localllm.planner.vision import plan_with_projector, projector_cost

        return plan_with_projector(
            card, projector_cost(projector),
            lambda card: choose_plan(shape, model_name, n_ctx, load, card=card,
                                     draft_shape=draft_shape, hint=hint, config=self.config()))

    def bands(self, shape: ModelShape, model_name: str, load: LoadOptions, plan: Plan,
              setting: str, hint: str | None = None) -> tuple[tuple[Plan, ...], Plan]:
        """Plans for the fill bands below `plan`'s context (config fill_bands), and the whole
        context's plan to load beside them (`plan` where there are none)."""
        from localllm.profiles.bands import choose_bands

        return choose_bands(shape, model_name, load, self.card(), plan, setting, hint,
                            self.config())

    def step_down(self, plan: Plan, shape: ModelShape, model_name: str,
                  error: str) -> Plan | None:
        from localllm.profiles.choose import step_down

        return step_down(plan, shape, self.card(), model_name, error, config=self.config())

    def card(self):
        """This machine's card as `tune` plans on it: the GPUs CUDA_VISIBLE_DEVICES and `gpus`
        leave, with what `tune --measure` and `--calibrate` measured (the speed factors, the
        bandwidths, the disk's read rate), so the daemon loads what `tune` explains."""
        from localllm.engine.hardware import probe_card
        from localllm.profiles.calibration import calibrated
        from localllm.profiles.choose import gpus_setting
        from localllm.profiles.host_prices import measured_on_first_use

        return measured_on_first_use(calibrated(probe_card(gpus_setting(self.config()))))


def context_to_ask(config: Config, n_ctx: int | None, shape: ModelShape) -> int | None:
    """The context a load asks the planner for: the request's num_ctx, else by policy."""
    if n_ctx is not None:
        return n_ctx
    if config.context_policy == "fixed":
        return config.default_ctx
    if config.context_policy == "max":
        return shape.context_length or config.default_ctx
    return None  # "fit": the tuner picks the largest context that keeps the model fast


def first_band(bands: tuple[Plan, ...], prompt_chars: int) -> int:
    """The fill band the request that loads a model needs: its prompt's tokens, estimated from
    its characters, and room to answer. len(bands) is the whole context's plan."""
    need = prompt_chars // CHARS_PER_TOKEN + 256
    return next((i for i, band in enumerate(bands) if band.n_ctx >= need), len(bands))


def prompt_disk(config: Config) -> tuple[Path | None, int]:
    """The prompt cache's folder on disk and the bytes its files may hold (setting
    prompt_cache_disk; 0: no folder)."""
    if config.prompt_cache_disk <= 0:
        return None, 0
    return paths.cache_dir() / "prompts", config.prompt_cache_disk * 2**20


def prompt_cache_bytes(config: Config) -> int:
    """The RAM a runner may keep prompts of taken slots in (setting prompt_cache_ram)."""
    if config.prompt_cache_ram != "auto":
        return int(config.prompt_cache_ram) * 2**20
    from localllm.engine.hardware import ram_available

    return min(PROMPT_CACHE_AUTO_MAX, ram_available() // 4)
