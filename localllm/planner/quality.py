"""What a KV cache setting costs in output quality, and the policy that decides which the tuner
may use (config `quality`).

A KV setting is a label: "f16", "q8_0", "q4_0" (K = V) or "q8_0/q4_0" (K / V). Its cost is the
KL divergence of the model's next-token distribution from the same model with an f16 cache, as
`localllm eval` measures it; until it is measured, a typical figure from llama.cpp's
`llama-perplexity --kl-divergence` runs on 7-8B models stands in, and every plan says which.
K is more sensitive than V (attention scores go through a softmax; values are only averaged),
so q8_0 K with q4_0 V comes before 4 bits for both.

Policies, each a threshold on the mean KL divergence:
    max       0.001  f16 unless a measurement shows a quantized cache is as good
    balanced  0.005  f16 or q8_0; 4 bits only where no more precise setting can keep the
                     context's KV on the GPU (the cache's size then decides the speed)
    speed     0.05   any setting, the fastest wins
Measured results live in `<config dir>/profiles/quality.toml`, one table per model
(profiles.eval_results reads and writes them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from localllm.kv_types import ASSUMED_KL, KV_LADDER, KV_SETTINGS, KV_TYPES

THRESHOLDS = {"max": 0.001, "balanced": 0.005, "speed": 0.05}
POLICIES = tuple(THRESHOLDS)
DEFAULT_POLICY = "balanced"
REFERENCE = "f16"


def kv_label(type_k: str, type_v: str) -> str:
    return type_k if type_k == type_v else f"{type_k}/{type_v}"


def split_kv(label: str) -> tuple[str, str]:
    """(type_k, type_v) of a label; ValueError for a label that is not a KV setting."""
    k, _, v = label.partition("/")
    v = v or k
    if k not in KV_TYPES or v not in KV_TYPES:
        raise ValueError(f"{label!r} is not a KV cache setting (e.g. {', '.join(KV_SETTINGS)})")
    return k, v


def kv_rank(label: str) -> int:
    """Lower is more precise."""
    return KV_LADDER.index(label) if label in KV_LADDER else len(KV_LADDER)


@dataclass(frozen=True)
class KvCost:
    label: str
    kl_mean: float
    measured: bool

    def describe(self) -> str:
        if self.label == REFERENCE:
            return "f16 is the reference (no loss)"
        how = "measured by `localllm eval`" if self.measured else \
            "assumed (typical for llama.cpp; `localllm eval MODEL` measures it)"
        return f"KL divergence {self.kl_mean:.4f} vs f16, {how}"


def kv_costs(measured: Mapping[str, float]) -> dict[str, KvCost]:
    """The cost of every setting in the ladder: measured where there is a figure."""
    out = {}
    for label in KV_LADDER:
        if label in measured:
            out[label] = KvCost(label, float(measured[label]), True)
        else:
            out[label] = KvCost(label, ASSUMED_KL[label], False)
    return out


def allowed(policy: str, costs: Mapping[str, KvCost]) -> tuple[str, ...]:
    threshold = THRESHOLDS[policy]
    return tuple(label for label in KV_LADDER
                 if label == REFERENCE or costs[label].kl_mean <= threshold)
