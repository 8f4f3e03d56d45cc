"""`localllm eval` on the real default model (SmolLM2 135M) with llama.cpp: a q8_0 KV cache
costs less quality than q4_0, the results are saved, and the tuner cites them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from localllm.modelstore.shape import read_shape
from localllm.planner.card import load_card
from localllm.profiles.eval_results import measured_kl
from localllm.profiles.evaluate import TEXT
from localllm.planner.search import Request
from localllm.planner.tuner import tune


def localllm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", *args], capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow
def test_q8_0_kv_costs_less_than_q4_0_and_the_tuner_reads_it(home, smollm2_gguf, tmp_path):
    # The first half of the bundled text: 4 chunks, about 500 scored tokens, where q4_0's KL
    # mean was 10 times q8_0's and its top-token agreement 7 points lower.
    half = tmp_path / "half.txt"
    full = TEXT.read_text(encoding="utf-8")
    half.write_text(full[: len(full) // 2], encoding="utf-8")
    done = localllm("eval", str(smollm2_gguf), "--kv", "q8_0,q4_0", "--ctx", "256", "--cpu",
                    "--file", str(half))
    assert done.returncode == 0, done.stderr
    print(done.stdout)  # the table, in the test log
    # How far it is, while it reads (it printed nothing for minutes before the table)
    progress = [ln for ln in done.stderr.splitlines() if ln.startswith("reading chunk ")]
    assert progress and progress[0].startswith("reading chunk 1 of 4 "), done.stderr
    assert "with the reference and 2 setting(s)" in progress[0]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in done.stdout.splitlines() if line.startswith("| ") and " KV " in line}
    q8, q4 = float(rows["q8_0 KV"][1]), float(rows["q4_0 KV"][1])
    assert 0 < q8 < q4
    assert float(rows["q8_0 KV"][3].rstrip("%")) >= float(rows["q4_0 KV"][3].rstrip("%"))
    shape = read_shape(smollm2_gguf)
    saved = measured_kl(smollm2_gguf.stem, shape.file_size)
    assert saved["q8_0"] == pytest.approx(q8, abs=1e-5) and saved["q4_0"] == pytest.approx(q4,
                                                                                          abs=1e-5)
    plan = tune(shape, load_card("cpu-only"), Request(kv_types=("q8_0",), measured_kl=saved))
    assert any(r.startswith("q8_0 KV cache: KL divergence") and "measured by `localllm eval`"
               in r for r in plan.reasons)


def test_eval_refuses_bad_input(home, smollm2_gguf, tmp_path):
    bad = localllm("eval", str(smollm2_gguf), "--kv", "q3_0")
    assert bad.returncode == 1 and "not a KV cache setting" in bad.stderr
    missing = localllm("eval", str(smollm2_gguf), "--file", str(tmp_path / "none.txt"))
    assert missing.returncode == 1 and "no such text file" in missing.stderr
    short = tmp_path / "short.txt"
    short.write_text("Too short to score.")
    few = localllm("eval", str(smollm2_gguf), "--kv", "q8_0", "--file", str(short), "--cpu")
    assert few.returncode == 1 and "needs at least 512" in few.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
