"""`localllm eval MODEL`: what a quantized KV cache (or another quant) costs in output quality.

    localllm eval smollm2                          q8_0, q8_0/q4_0 and q4_0 KV vs f16 KV
    localllm eval smollm2 --kv q8_0                one setting
    localllm eval 27b-q3 --vs 27b-q8               this quant vs another quant of the model
    localllm eval model.gguf --file book.txt       on your own text

Prints perplexity and the KL divergence to the reference (mean, 99th percentile) and how often
the two agree on the most likely token; saves the results per (model, setting), where the tuner
reads them to decide which KV settings `quality` allows (planner.quality).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from localllm.errors import UserError
from localllm.kv_types import KV_LADDER

DEFAULT_SETTINGS = ",".join(KV_LADDER[1:])  # every rung below f16, the reference


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="measure what a quantized KV cache or another quant costs in quality",
        description="Run MODEL over a text with llama.cpp and compare its next-token "
        "distributions with a reference (f16 KV, or another quant with --vs): KL divergence "
        "(mean, p99), top-token agreement and perplexity. Results are saved and used by the "
        "tuner's quality policy.")
    p.add_argument("model", help="a stored model's name or a path to a .gguf file")
    p.add_argument("--kv", default=None, metavar="TYPES",
                   help="KV settings to test, comma-separated: q8_0, q4_0, q8_0/q4_0 (K/V) "
                   f"(default: {DEFAULT_SETTINGS}; with --vs: f16)")
    p.add_argument("--vs", default="f16", metavar="f16|MODEL",
                   help="the reference: f16 KV of the same model (default) or another quant "
                   "of it (a stored name or .gguf path)")
    p.add_argument("--file", type=Path, metavar="TEXT",
                   help="a UTF-8 text to evaluate on (default: a bundled public-domain sample, "
                   "two chapters of Pride and Prejudice)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512; the "
                   "second half of each chunk is scored)")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even with a GPU")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--no-save", action="store_true", help="do not save the results")
    p.set_defaults(func=cmd_eval)


def _settings(text: str) -> list[str]:
    from localllm.planner.quality import split_kv

    settings = [s.strip() for s in text.split(",") if s.strip()]
    if not settings:
        raise UserError("--kv needs at least one KV setting, e.g. --kv q8_0")
    for s in settings:
        try:
            split_kv(s)
        except ValueError as e:
            raise UserError(f"--kv: {e}") from None
    return settings


def _text(path: Path | None) -> str:
    from localllm.profiles.evaluate import TEXT

    path = path or TEXT
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"no such text file: {path}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None


def cmd_eval(args: argparse.Namespace) -> int:
    from localllm.profiles.evaluate import evaluate_in_child
    from localllm.profiles.eval_results import save_result

    if args.ctx < 64:
        raise UserError("--ctx must be at least 64")
    text = _text(args.file)
    shape, name = _local_model(args.model)
    reference_path, reference = None, "f16"
    if args.vs != "f16":
        ref_shape, reference = _local_model(args.vs)
        reference_path = ref_shape.path
    settings = _settings(args.kv or ("f16" if reference_path else DEFAULT_SETTINGS))
    if not reference_path and "f16" in settings:
        raise UserError("f16 KV is the reference: test q8_0, q4_0 or q8_0/q4_0, or compare "
                        "with another quant (--vs MODEL)")
    results = evaluate_in_child(shape.path, settings, text, args.ctx, reference_path,
                                reference, n_gpu_layers=0 if args.cpu else 999,
                                on_progress=_show_progress(len(settings)))
    saved = None
    if not args.no_save:
        for r in results:
            saved = save_result(name, shape.file_size, r.setting, r.reference,
                                {"kl_mean": r.kl_mean, "kl_p99": r.kl_p99,
                                 "top_agreement": r.top_agreement, "perplexity": r.perplexity,
                                 "reference_perplexity": r.reference_perplexity,
                                 "n_tokens": r.n_tokens})
    if args.json:
        print(json.dumps({"model": name, "results": [asdict(r) for r in results],
                          "saved": str(saved) if saved else None}, indent=2))
        return 0
    print(format_table(name, results))
    if saved:
        print(f"\nsaved to {saved}; `localllm tune {args.model}` uses them")
    return 0


def _local_model(model: str):
    """(shape, name) of a stored model or a GGUF file: eval reads the weights, which a catalog
    name not pulled yet (planned from its header) does not have here."""
    from localllm.cli.tune import resolve_model

    shape, name, remote = resolve_model(model)
    if remote:
        raise UserError(f"{model} is not pulled: eval reads its weights; run `localllm pull "
                        f"{model}` first")
    return shape, name


def _show_progress(n_settings: int):
    """How far the evaluation is, on stderr: one line rewritten in a terminal, a line per tenth
    of the text otherwise (a log)."""
    tty = sys.stderr.isatty()
    started = time.monotonic()

    def show(done: int, total: int) -> None:
        if not tty and done % max(1, total // 10):
            return
        elapsed = time.monotonic() - started
        left = f", about {elapsed / done * (total - done):.0f} s left" if done else ""
        line = (f"reading chunk {done + 1} of {total} with the reference and "
                f"{n_settings} setting(s){left}")
        print(f"\r{line}\x1b[K" if tty else line, end="" if tty else "\n", file=sys.stderr,
              flush=True)
        if tty and done + 1 == total:
            print(file=sys.stderr)

    return show


def format_table(name: str, results: list) -> str:
    ref = results[0]
    what = "KV" if ref.reference == "f16" else "weights"
    header = ["setting", "reference", "KL mean", "KL p99", "top-token agreement", "perplexity"]
    rows = [["f16 KV" if what == "KV" else ref.reference, "-", "0", "0", "100.0%",
             f"{ref.reference_perplexity:.3f}"]]
    for r in results:
        label = f"{r.setting} KV" if what == "KV" else f"{name} ({r.setting} KV)"
        rows.append([label, f"{r.reference} {'KV' if what == 'KV' else ''}".strip(),
                     f"{r.kl_mean:.5f}", f"{r.kl_p99:.4f}", f"{100 * r.top_agreement:.1f}%",
                     f"{r.perplexity:.3f}"])
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [f"{name}: {ref.n_tokens} scored tokens",
             "| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |",
             "| " + " | ".join("-" * w for w in widths) + " |"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
              for row in rows]
    return "\n".join(lines)
