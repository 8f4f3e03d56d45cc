"""What a KV cache setting (or another quant) costs in output quality, measured with llama.cpp.

As `llama-perplexity --kl-divergence` does: the text is cut into chunks of n_ctx tokens, each
starting with BOS; every chunk is decoded once with the reference (f16 KV, or another file of the
same model) and once per tested setting, and the second half of each chunk is scored (those
tokens see at least n_ctx / 2 of context, which is where a quantized cache is read most). Per
scored token: the KL divergence of the tested next-token distribution from the reference's,
whether the two agree on the most likely token, and the tested log-likelihood of the real next
token (perplexity).

The logits come from llama.cpp's low-level API in the engine's child program (the runner, whose
engine/runner/tuner_ops.py runs engine/evaluate.py), as for `tune --measure`: a CUDA build must not
share a process with the daemon or with numpy loaded first.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from localllm.errors import UserError

from localllm.engine.probes import EvalResult, Evaluate
from localllm.engine.probing import ProbeFailed, ask

TEXT = Path(__file__).resolve().parent / "eval_text.txt"
DEFAULT_CTX = 512


def evaluate_in_child(model_path: str, settings: list[str], text: str, n_ctx: int = DEFAULT_CTX,
                      reference_path: str | None = None, reference_name: str = "f16",
                      n_gpu_layers: int = 999, timeout: float = 1800,
                      on_progress: Callable[[int, int], None] | None = None,
                      ) -> list[EvalResult]:
    """`on_progress(done, total)`: called as the child starts each chunk of the text."""
    request = Evaluate(model_path, tuple(settings), text, n_ctx, reference_path, reference_name,
                       n_gpu_layers)
    try:
        return list(ask(request, timeout, on_progress).results)
    except ProbeFailed as e:
        if e.timed_out:
            raise UserError(f"the evaluation took longer than {timeout:.0f} s and was "
                            "stopped") from None
        raise UserError(f"the evaluation failed: {e}") from None
