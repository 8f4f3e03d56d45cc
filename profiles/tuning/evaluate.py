"""What a KV cache setting (or another quant) costs in output quality, measured with llama.cpp.

As `llama-perplexity --kl-divergence` does: the text is cut into chunks of n_ctx tokens, each
starting with BOS; every chunk is decoded once with the reference (f16 KV, or another file of the
same model) and once per tested setting, and the second half of each chunk is scored (those
tokens see at least n_ctx / 2 of context, which is where a quantized cache is read most). Per
scored token: the KL divergence of the tested next-token distribution from the reference's,
whether the two agree on the most likely token, and the tested log-likelihood of the real next
token (perplexity).

The logits come from llama.cpp's low-level API in a child process (llama/evaluate.py, request
as JSON on stdin, result as JSON on stdout), as for `tune --measure`: a CUDA build must not
share a process with the daemon or with numpy loaded first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import UserError

TEXT = Path(__file__).resolve().parent.parent / "eval_text.txt"
DEFAULT_CTX = 512


@dataclass(frozen=True)
class EvalResult:
    setting: str  # "q8_0" (KV) or "f16" for the other model
    reference: str  # "f16" (KV of the same model) or the other model's name
    kl_mean: float
    kl_p99: float
    top_agreement: float  # fraction of scored tokens whose most likely next token agrees
    perplexity: float
    reference_perplexity: float
    n_tokens: int  # scored tokens


def evaluate_in_child(model_path: str, settings: list[str], text: str, n_ctx: int = DEFAULT_CTX,
                      reference_path: str | None = None, reference_name: str = "f16",
                      n_gpu_layers: int = 999, timeout: float = 1800,
                      on_progress: Callable[[int, int], None] | None = None,
                      ) -> list[EvalResult]:
    """`on_progress(done, total)`: called as the child starts each chunk of the text."""
    request = json.dumps({"model": model_path, "reference_model": reference_path,
                          "settings": settings, "text": text, "n_ctx": n_ctx,
                          "n_gpu_layers": n_gpu_layers})
    with tempfile.TemporaryFile("w+") as stderr, subprocess.Popen(
            [sys.executable, "-m", "localllm.llama.evaluate"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=stderr, text=True) as proc:
        proc.stdin.write(request)
        proc.stdin.close()
        timed_out = threading.Event()
        timer = threading.Timer(timeout, lambda: (timed_out.set(), proc.kill()))
        timer.start()
        last = ""
        try:
            for line in proc.stdout:  # progress lines, then the result's
                last = line
                if on_progress and line.startswith('{"progress"'):
                    on_progress(*json.loads(line)["progress"])
        finally:
            timer.cancel()
        code = proc.wait()
        stderr.seek(0)
        errors = stderr.read()
    if timed_out.is_set():
        raise UserError(f"the evaluation took longer than {timeout:.0f} s and was stopped")
    if code != 0:
        lines = errors.strip().splitlines()
        final = lines[-1] if lines else f"exit {code}"
        raise UserError(f"the evaluation failed: {final.removeprefix('Error: ')}")
    out = json.loads(last)
    return [EvalResult(setting=r["setting"], reference=reference_name,
                       **{k: r[k] for k in ("kl_mean", "kl_p99", "top_agreement", "perplexity",
                                           "reference_perplexity", "n_tokens")})
            for r in out["results"]]
