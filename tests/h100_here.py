"""An H100 at 12 GiB as this machine's probe would give it (the card the #65 MoE tests plan on),
with the read rates measured on an H100 lease's host, and the synthetic Qwen3-30B-A3B header
they plan (the real tensor table, no weights)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from scripts import synth_gguf

from localllm.modelstore.shape import ModelShape, read_shape
from localllm.planner.card import Card, load_card

PRICES = json.loads((Path(__file__).parent / "fixtures" / "h100-moe-prices.json").read_text())


def h100_here(**served) -> Card:
    """The card; `served`: Card fields as serving would have corrected them."""
    rates = tuple(sorted((int(t), gbs) for t, gbs in PRICES["read_gbs"].items()))
    return replace(load_card("h100").with_vram(12), source="probe", cores=16,
                   host_bandwidth_gbs=51.2, host_read_gbs=rates, **served)


def qwen3_header(folder: Path) -> ModelShape:
    path = folder / "qwen3-30b-a3b.gguf"
    synth_gguf.write_gguf(path, synth_gguf.SHAPES["qwen3-30b-a3b"], "Q4_0", "sparse")
    return read_shape(path)
