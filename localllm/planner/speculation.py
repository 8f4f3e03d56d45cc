"""Speculative decoding, planned with the placement: which way of drafting may run, what it costs
in memory, and what it is expected to gain.

A pass of the target model checks k drafted tokens and the next one together (its price per
device is `checking.checking_terms`). At acceptance a per drafted token, a pass yields
(1 - a^(k+1)) / (1 - a) tokens on average, so

    tok/s with speculation = expected tokens / (checking pass of k + 1 + k draft steps)

Three ways to draft (the runner's `plan.speculative`):
- "lookup": n-grams of the prompt and the answer. Free to draft, no memory; acceptance depends
  on the work (an editor's rewrite repeats its input, a chat rarely does).
- "mtp": the model's own NextN block(s) (`{arch}.nextn_predict_layers > 0`), loaded with
  `load_mtp` plus a second context holding the NextN layer's own KV. A draft step reads the
  NextN block and the lm-head.
- "draft": a second small model with the same vocabulary (paired through the catalog). A draft
  step is one decode of that model on its own placement; its weights and KV (same n_ctx, KV
  types and slots as the target) count against the same budget.

Models with recurrent state (Gated DeltaNet, Mamba) cannot roll back rejected drafts: lookup and
draft are not planned for them. MTP is, since llama.cpp keeps the state for it (qwen35).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from localllm.modelstore.shape import ModelShape
from localllm.speculative import mode as mode_row

from .card import Card
from .costs import ModelCosts, model_costs
from .memory import (CPU, ComputeTable, ContextSettings, block_devices, memory_by_device,
                     page_table_bytes)
from .placements import Placement, in_ram
from .plan import DeviceMemory
from .checking import checking_terms
from .speed import ExpertPool, Speed, predict_speed

# Acceptance per drafted token, used until the runner has measured it (Request.acceptance):
# - mtp 0.7: Qwen3.6-27B/35B-A3B with llama.cpp's draft-mtp accepted 0.80 of drafts over nine
#   task kinds (0.48 creative to 0.93 math; llama.cpp PR #22673), and a teacher-forced, greedy
#   measurement of Qwen3.5-class MTP heads gave 0.65 pooled (code 0.91, prose 0.49;
#   tenstorrent/vllm issue #442). 0.7 sits between the two.
# - draft 0.6: a small model of the same family; it depends on the pair (Gemma 3 270M drafting
#   12B was reported at about 1.8x, Gemma 4 assistants at 77-97%), so a middle value.
# - lookup 0.3: chat rarely repeats its prompt; kept low so that `auto` turns lookup on only
#   where a checking pass is nearly free (every block on the GPU).
ASSUMED_ACCEPTANCE = {"mtp": 0.7, "draft": 0.6, "lookup": 0.3}
DRAFT_LENGTHS = (1, 2, 3, 4, 6, 8)  # draft_n_max values compared
# Speculation must beat plain decode by this much: below it the model cannot tell them apart,
# and the drafts cost energy and sampling work.
SPECULATION_MARGIN = 1.05
# llama.cpp's compatibility rule for a draft model (common/speculative.cpp).
MAX_VOCAB_DIFFERENCE = 128


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one pass yields on average with k drafts, each accepted with probability a while
    all before it were (the checked pass always yields one token of its own)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


@dataclass(frozen=True)
class Speculator:
    """One way of drafting the tuner may plan, with the costs of what it loads beside the
    target. `draft_lengths` are the draft_n_max values tried (one, once an option chose it)."""

    mode: str
    acceptance: float
    measured: bool
    # What a draft step reads and what the drafter keeps in memory, as a ModelCosts: the draft
    # model's own, or for MTP the target's NextN block alone (with its KV layer); None: lookup.
    step_costs: ModelCosts | None = None
    # Its memory: like step_costs, less what it shares with the target (MTP: the lm-head).
    memory_costs: ModelCosts | None = None
    draft_n_gpu_layers: int = 0  # draft model: its layers on the GPU (llama.cpp's -ngld)
    draft_name: str = ""
    draft_lengths: tuple[int, ...] = DRAFT_LENGTHS

    @property
    def needs_memory(self) -> bool:
        return self.memory_costs is not None

    def placement(self, target: Placement) -> Placement:
        """Where the drafter's weights sit: the NextN block follows the target's placement, a
        draft model has its own."""
        if mode_row(self.mode).draft_model:
            return Placement(self.draft_n_gpu_layers)
        return target


@dataclass(frozen=True)
class SpeculationChoice:
    """What an option's speculation was priced at, for the plan and its reasons."""

    mode: str
    draft_n_max: int
    acceptance: float
    measured: bool
    check_ratio: float  # a checking pass of draft_n_max + 1 tokens over a pass of one
    draft_seconds: float  # per drafted token
    plain_tps: float  # the same placement without speculation
    tps: float
    draft_n_gpu_layers: int = 0

    @property
    def gain(self) -> float:
        return self.tps / self.plain_tps if self.plain_tps else 0.0

    @property
    def pays(self) -> bool:
        return self.gain >= SPECULATION_MARGIN


def speculators(shape: ModelShape, costs: ModelCosts, card: Card, draft: ModelShape | None = None,
                measured: Mapping[str, float] | None = None) -> tuple[list[Speculator], list[str]]:
    """The ways of drafting this model may use, and a sentence for each one left out."""
    measured = measured or {}

    def acceptance(mode: str) -> tuple[float, bool]:
        if mode in measured and 0.0 <= measured[mode] <= 1.0:
            return float(measured[mode]), True
        return ASSUMED_ACCEPTANCE[mode], False

    out: list[Speculator] = []
    notes: list[str] = []
    if shape.n_nextn > 0:
        step, memory = _nextn_costs(shape)
        out.append(Speculator("mtp", *acceptance("mtp"), step_costs=step, memory_costs=memory))
    recurrent = any(costs.state_bytes)
    if recurrent:
        notes.append(f"lookup and draft-model speculation not planned: {shape.architecture}'s "
                     "recurrent state is taken back past a rejected draft only from snapshots "
                     "llama.cpp keeps, one per draft position"
                     + (", which MTP's short drafts keep few" if shape.n_nextn else ""))
        return out, notes
    out.append(Speculator("lookup", *acceptance("lookup")))
    if draft is not None:
        difference = abs(draft.n_vocab - shape.n_vocab)
        if difference > MAX_VOCAB_DIFFERENCE:
            notes.append(f"draft model {draft.name} not used: its vocabulary ({draft.n_vocab}) "
                         f"differs from the model's ({shape.n_vocab}) by more than "
                         f"{MAX_VOCAB_DIFFERENCE} tokens")
        else:
            draft_costs = model_costs(draft)
            a, was_measured = acceptance("draft")
            # Every draft layer on the GPU where it fits, else the draft in RAM: the search
            # prices both against what they take from the target.
            for layers in ((draft_costs.n_blocks + 1, 0) if card.has_gpu else (0,)):
                out.append(Speculator("draft", a, was_measured, step_costs=draft_costs,
                                      memory_costs=draft_costs, draft_n_gpu_layers=layers,
                                      draft_name=draft.name))
    return out, notes


def _nextn_costs(shape: ModelShape) -> tuple[ModelCosts, ModelCosts]:
    """The NextN block alone, as a model to price one MTP draft step (its weights, its own KV
    layer over the context, the lm-head it shares with the target) and its memory (the same
    without the lm-head, the token table and the final norm, which the target already holds)."""
    full = model_costs(shape, load_mtp=True)
    nextn = {layer.index for layer in shape.layers if layer.is_nextn}

    def only(values: tuple) -> tuple:
        return tuple(v if i in nextn else 0 for i, v in enumerate(values))

    k_el = tuple(layer.n_head_kv * layer.head_dim_k if layer.index in nextn else 0
                 for layer in shape.layers)
    v_el = tuple(layer.n_head_kv * layer.head_dim_v if layer.index in nextn else 0
                 for layer in shape.layers)
    flops = tuple(2 * shape.n_head * (layer.head_dim_k + layer.head_dim_v)
                  if layer.index in nextn else 0 for layer in shape.layers)
    step = replace(full, block_bytes=only(full.block_bytes), ffn_bytes=only(full.ffn_bytes),
                   expert_bytes=only(full.expert_bytes), block_params=only(full.block_params),
                   kv_k_elements=k_el, kv_v_elements=v_el, state_bytes=(0,) * full.n_blocks,
                   attention_flops=flops, embedding_bytes=0, cpu_other_bytes=0)
    memory = replace(step, output_bytes=0, output_norm_bytes=0, output_params=0)
    return step, memory


def drafter_memory(spec: Speculator, placement: Placement, settings: ContextSettings,
                   card: Card, compute: ComputeTable | None = None) -> tuple[DeviceMemory, ...]:
    """What the drafter adds per device: its weights, its KV (n_ctx cells per slot, the target's
    KV types) and its context's compute buffer; the CUDA context is the target's."""
    if spec.memory_costs is None:
        return ()
    # A measured compute table is the target's; the drafter's context is estimated by formula.
    del compute
    memory = memory_by_device(spec.memory_costs, spec.placement(placement), settings, card)
    return tuple(replace(m, overhead=0) for m in memory)


def with_drafter(memory: tuple[DeviceMemory, ...],
                 extra: tuple[DeviceMemory, ...]) -> tuple[DeviceMemory, ...]:
    """The target's memory per device with the drafter's added to the same devices, and on
    each GPU the page tables of the drafter's weights in RAM (registered with the target's)."""
    added = {m.device: m for m in extra}
    ram_before = next((m.weights for m in memory if m.device == CPU), 0)
    ram_added = added[CPU].weights if CPU in added else 0
    tables = page_table_bytes(ram_before + ram_added, 0) - page_table_bytes(ram_before, 0)
    out = []
    for m in memory:
        e = added.get(m.device)
        out.append(m if e is None else replace(
            m, weights=m.weights + e.weights, kv=m.kv + e.kv, compute=m.compute + e.compute,
            overhead=m.overhead + (tables if m.device != CPU else 0)))
    return tuple(out)


def draft_step_seconds(spec: Speculator, placement: Placement, settings: ContextSettings,
                       card: Card, n_threads: int | None, depth: int) -> float:
    """One drafted token: nothing for lookup (n-gram matching inside the runner's loop), one
    decode step of the drafter on its placement otherwise."""
    if spec.step_costs is None:
        return 0.0
    step = predict_speed(spec.step_costs, spec.placement(placement), settings, card, n_threads,
                         depth)
    return 1.0 / step.decode_tps


def speculative_speed(spec: Speculator, costs: ModelCosts, placement: Placement,
                      settings: ContextSettings, card: Card, n_threads: int | None,
                      depth: int, pool: ExpertPool | None = None
                      ) -> tuple[Speed, SpeculationChoice]:
    """Decode with this speculator on this placement at the best draft length (`pool`: the
    target's expert cache, which serves its checking passes too)."""
    terms = checking_terms(costs, placement, settings, card, n_threads, depth, pool)
    plain = predict_speed(costs, placement, settings, card, n_threads, depth, pool)
    draft_s = draft_step_seconds(spec, placement, settings, card, n_threads, depth)
    best: SpeculationChoice | None = None
    for k in spec.draft_lengths:
        tps = expected_tokens(spec.acceptance, k) / (terms.seconds(k + 1) + k * draft_s)
        if best is None or tps > best.tps:
            best = SpeculationChoice(spec.mode, k, spec.acceptance, spec.measured,
                                     terms.ratio(k + 1), draft_s, plain.decode_tps, tps,
                                     spec.draft_n_gpu_layers)
    assert best is not None
    return replace(plain, decode_tps=best.tps), best


def cpu_blocks(costs: ModelCosts, placement: Placement, card: Card) -> int:
    """Trunk blocks whose weights (whole, their FFN, or their experts) are read on the CPU:
    a checking pass reads there the union of its tokens' experts."""
    devices = block_devices(costs, placement, card.n_gpus if card.has_gpu else 0)
    kept = in_ram(costs, placement)
    return sum(1 for i in range(costs.n_blocks)
               if (costs.block_bytes[i] or costs.expert_bytes[i])
               and (devices[i] == CPU or kept.named[i]))
