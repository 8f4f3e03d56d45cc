"""The baseline benchmark's arithmetic: medians with their spread, and ours over the strongest
baseline of the same file, whichever system that is for each figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ("-m", "scripts.bench.bench_baseline")  # run from ROOT


def rows() -> list[dict]:
    out = []
    for r, (ours, vendored, newest) in enumerate([(90, 60, 70), (80, 66, 75), (85, 61, 72)]):
        out += [{"phase": "round", "round": r, "system": "ours", "short_decode_tps": ours,
                 "ttft_s": 5.0 + r},
                {"phase": "round", "round": r, "system": "vendored-fit",
                 "short_decode_tps": vendored, "ttft_s": 9.0},
                {"phase": "round", "round": r, "system": "newest-fit",
                 "short_decode_tps": newest, "ttft_s": 4.0 + r}]
    # a sweep row and a failed run are no part of the medians
    out += [{"phase": "sweep", "system": "newest-fit", "short_decode_tps": 500},
            {"phase": "round", "round": 3, "system": "ours", "error": "RuntimeError: died"}]
    return out


def test_the_summary_gives_medians_spread_and_the_ratio_to_the_strongest_baseline(tmp_path):
    jsonl = tmp_path / "baseline.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    table = subprocess.run([sys.executable, *SCRIPT, "--summarize", str(jsonl)],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=True).stdout
    line = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]]
            for ln in table.splitlines()[2:]}
    ours, newest, vendored = line["short_decode_tps"][:3]
    assert ours == "85 [80-90] (3)" and newest == "72 [70-75] (3)" and vendored == "61 [60-66] (3)"
    # the strongest baseline is the faster one: newest, not vendored; 85 / 72
    assert line["short_decode_tps"][3] == "1.18x (newest-fit)"
    # less is better for the time to the first token: newest's 5.0 against ours 6.0
    assert line["ttft_s"][3] == "0.83x (newest-fit)"
    assert line["prompt_tps"] == ["-", "-", "-", "-"]
