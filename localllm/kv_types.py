"""The KV cache's types, spelled once: what llama.cpp stores (-ctk/-ctv) and what a user may pin.

A KV setting is a label: one type for K and V ("q8_0") or a K/V pair ("q8_0/q4_0"). The config's
words (kv_cache_type), `localllm tune --kv` and `localllm eval --kv`, the planner's sizes and its
quality ladder, and the saved profiles' checks all read this table.
"""

from __future__ import annotations

# (elements per block, bytes per block) of the KV cache types llama.cpp accepts (-ctk/-ctv).
KV_TYPES: dict[str, tuple[int, int]] = {
    "f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
    "q4_1": (32, 20), "iq4_nl": (32, 18), "q5_0": (32, 22), "q5_1": (32, 24),
}
# What the planner weighs, most precise first (default CUDA builds have flash-attention kernels
# for these; a q8_0 K with a q4_0 V attends on the CPU), and the KL divergence against f16 each
# is assumed to cost until `localllm eval` has measured the model.
KV_LADDER = ("f16", "q8_0", "q8_0/q4_0", "q4_0")
ASSUMED_KL = {"f16": 0.0, "bf16": 0.0, "q8_0": 0.002, "q8_0/q4_0": 0.01, "q4_0": 0.03}
# The settings a user may pin (config kv_cache_type, --kv): the ladder and bf16.
KV_SETTINGS = ("f16", "bf16", "q8_0", "q4_0", "q8_0/q4_0")
