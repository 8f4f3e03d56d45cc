"""The tuner's search types: what the user asked (`Request`), one configuration priced
(`Option`, with its `SessionTime`), and everything one context's search saw (`Search`).

Their own module so that the search (tuner, evaluator), the plan it builds (build) and the words
that explain it (explain) all read them without importing each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from localllm.errors import UserError

from . import quality
from .card import MIB
from .disk import non_weight_ram_fits
from .memory import CPU, ContextSettings
from .placements import Placement
from .plan import DeviceMemory
from .quality import kv_label
from .speculation import SpeculationChoice, Speculator
from .speed import ExpertPool, Speed
from .workload import HALF_FILL, Turn, Workload

MIN_DEFAULT_CTX = 4096


class NoPlanFits(UserError):
    """The model cannot run as asked on this card and host; the message says what would."""


@dataclass(frozen=True)
class Request:
    """What the user asked for; None lets the tuner choose."""

    n_ctx: int | None = None
    margin_bytes: int = 512 * MIB  # VRAM left free on each GPU (config vram_margin_mib)
    kv_types: tuple[str, ...] | None = None  # KV settings pinned (config kv_cache_type)
    n_gpu_layers: int | None = None  # Ollama's num_gpu
    n_threads: int | None = None  # num_thread
    n_batch: int | None = None  # num_batch
    # Micro-batches compared: bigger ones read a prompt faster where weights in RAM cross to
    # the GPU per micro-batch, and take a bigger compute buffer.
    ubatch_sizes: tuple[int, ...] = (2048, 1024, 512, 256)
    quality: str = quality.DEFAULT_POLICY  # config quality: max, balanced, speed
    measured_kl: Mapping[str, float] = field(default_factory=dict)  # `localllm eval` results
    # The session planned for. The daemon and `tune` pass the config's (workload, chat by
    # default, or the older expected_fill); a bare Request keeps the older half-fill objective.
    workload: Workload = HALF_FILL
    workload_source: str = ""  # where the workload came from: the record, a route, the config
    # The session opens with a prompt someone waits on (a fill band entered by a long prompt):
    # plans that read it slower than FIRST_PROMPT_SLACK times the fastest are set aside.
    first_prompt_waits: bool = False
    ram_budget_bytes: int | None = None  # config ram_budget; None: what the card has available
    num_parallel: int | None = 1  # slots: a cap; None = auto (as many as fit, at most 4)
    ffn_split: bool = True  # may a block's FFN sit in RAM apart from its attention
    # Measured acceptance per speculative mode ("mtp", "draft", "lookup"); others are assumed
    # (planner.speculation.ASSUMED_ACCEPTANCE).
    acceptance: Mapping[str, float] = field(default_factory=dict)
    speculation: bool = True  # may the plan turn speculative decoding on
    # The smallest context a plan chosen without n_ctx gets (config default_ctx under the
    # `fit` policy): the tuner goes larger only where that costs no speed.
    min_ctx: int = MIN_DEFAULT_CTX
    # MoE expert cache (config expert_cache; planner/expert_pool.py): the slots asked
    # (0: off), and where the pool goes (config expert_cache_device: "cpu", in RAM, for tests)
    expert_cache: int = 0  # AUTO_SLOTS: the tuner sizes it (or turns it off)
    expert_cache_device: str = "gpu"
    # who computes the pool's misses (config expert_misses): "auto" prices both, "cpu", "gpu"
    expert_misses: str = "auto"
    # Hit rates measured while serving the model: (slots per served block / n_expert, hit
    # rate), replacing the prior curve where they were measured (expert_pool.hit_curve)
    measured_hits: tuple[tuple[float, float], ...] = ()
    # Each way's decode measured while serving this model file (profiles/ways.py), by what it
    # was measured under (ways.situation): {situation: {way: tok/s}}
    measured_ways: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    expert_pool: ExpertPool | None = None  # the pool as decode is priced with it (expert_pool.py)
    # VRAM kept out of the first GPU's budget for the placement (the expert cache's pool)
    reserved_vram_bytes: int = 0


@dataclass(frozen=True)
class Option:
    """One evaluated configuration: a placement at some context settings, and what it costs."""

    placement: Placement
    settings: ContextSettings
    memory: tuple[DeviceMemory, ...]
    speed: Speed  # decode averaged over the session's answers (prefill: one micro-batch)
    vram_budget: int  # per GPU (several GPUs: the smallest; device_budgets has each)
    ram_budget: int
    disk_bytes: int = 0  # weights read from disk per token: past RAM, they stay mmapped
    # Speculative decoding: how it drafts (None: plain decode) and what it was priced at; the
    # memory above includes the drafter's and the speed is the speculative one.
    speculator: Speculator | None = None
    speculation: SpeculationChoice | None = None
    session: SessionTime | None = None  # the workload's session on this option
    device_budgets: tuple[tuple[str, int], ...] = ()  # several GPUs: each one's usable VRAM

    @property
    def session_seconds(self) -> float:
        return self.session.total if self.session is not None else float("inf")

    @property
    def pays(self) -> bool:
        """Plain decode, or speculation that beats plain decode on this placement."""
        return self.speculation is None or self.speculation.pays

    @property
    def kv(self) -> str:
        return kv_label(self.settings.type_k, self.settings.type_v)

    @property
    def gpu_fits(self) -> bool:
        budgets = dict(self.device_budgets)
        return all(m.total <= budgets.get(m.device, self.vram_budget)
                   for m in self.memory if m.device != CPU)

    @property
    def ram_fits(self) -> bool:
        """Weights past the RAM budget are read from the mmapped file (planner.disk); what is
        allocated (KV, compute buffers) must fit."""
        return non_weight_ram_fits(self.memory, self.ram_budget)

    @property
    def fits(self) -> bool:
        return self.gpu_fits and self.ram_fits

    @property
    def vram_used(self) -> int:
        return max((m.total for m in self.memory if m.device != CPU), default=0)

    @property
    def ram_used(self) -> int:
        return sum(m.total for m in self.memory if m.device == CPU)

    @property
    def kv_on_gpu(self) -> bool:
        """Every block's KV (so its attention) is on a GPU."""
        return any(m.device != CPU for m in self.memory) and \
            not any(m.kv for m in self.memory if m.device == CPU)


@dataclass(frozen=True)
class SessionTime:
    """A session of the workload on one option: seconds reading prompts and decoding, per turn."""

    turns: tuple[Turn, ...]
    prompt_seconds: tuple[float, ...]
    decode_seconds: tuple[float, ...]

    @property
    def total(self) -> float:
        return sum(self.prompt_seconds) + sum(self.decode_seconds)

    @property
    def prompt_total(self) -> float:
        return sum(self.prompt_seconds)

    @property
    def decode_total(self) -> float:
        return sum(self.decode_seconds)

    @property
    def decode_tps(self) -> float:
        answered = sum(t.answer for t in self.turns)
        return answered / self.decode_total if self.decode_total > 0 else 0.0


@dataclass(frozen=True)
class Search:
    """Everything the search saw at one context: the winner, the alternatives, and what the
    quality policy did (a sentence, empty when it simply allowed the winner)."""

    n_ctx: int
    best: Option | None
    options: tuple[Option, ...] = field(default=())
    quality_note: str = ""
    prompt_note: str = ""  # what the prompt-reading floor did (speed.below_prompt_floor)
