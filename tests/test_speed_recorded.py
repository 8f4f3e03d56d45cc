"""The speed model against decode the daemon measured on the H200 (lab/runs/*.jsonl, priced
again at each run's measured expert-pool hits by scripts/bench/reprice_runs.py): a constant refitted
for one shape must not quietly break the others."""

from __future__ import annotations

from pathlib import Path

from scripts.bench import reprice_runs

BENCH = Path(__file__).resolve().parent / "fixtures" / "runs"  # copies of lab/runs/
RECORDED = ("h200-2026-12-03-round10.jsonl", "h200-2026-12-03-round11.jsonl",
            "h200-2026-12-03-round12.jsonl")
# Issue 37 asks 15% of the plan's prediction, which also guesses the hit rate. The same plan
# on the same file measured 5-7% apart from lease to lease (Qwen3-30B-A3B at 12 GiB, first
# short answer: 119.8 tok/s in one lease, 126.3 in another).
WITHIN = 0.12


def recorded_runs():
    return reprice_runs.runs(reprice_runs.read_rows(BENCH / name for name in RECORDED))


def test_every_recorded_moe_run_is_priced_within_twelve_percent():
    runs = recorded_runs()
    shapes = {r.label.split()[1] for r in runs}
    # the pool's three shapes, and both hybrids with every weight on the GPU
    assert {"qwen3-next-80b-a3b", "qwen35-35b-a3b", "qwen3-30b-a3b",
            "qwen35-35b-a3b-e16", "qwen3-next-80b-a3b-e16"} <= shapes
    assert len(runs) >= 40
    off = [f"{r.label}: {r.error:+.1%}" for r in runs if abs(r.error) > WITHIN]
    assert not off, off


def test_a_recurrent_block_on_the_gpu_is_priced(monkeypatch):
    """The hybrids' recurrent blocks cost their own kernels on the GPU: priced like attention
    blocks, every weight on the GPU, the model was 35-50% fast."""
    from localllm.planner import speed

    monkeypatch.setattr(speed, "GPU_RECURRENT_BLOCK_SECONDS", 0.0)
    resident = [r for r in recorded_runs() if "-e16 " in r.label]
    assert resident and all(r.error > 0.3 for r in resident)
