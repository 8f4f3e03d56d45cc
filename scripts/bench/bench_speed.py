#!/usr/bin/env python3
"""Prompt-lookup speculation through the API: acceptance and speedup against plain decode.

    python -m scripts.bench.bench_speed [--model PATH] [--tokens 400] [--rounds 2]

Three cases, each answered with `speculative: off` and `lookup` (interleaved rounds, medians):
repeating a ~400-token code listing with one change, greedy (drafts from the prompt should
pay); a story, greedy (a small model's text loops); the same story sampled at temperature 1,
a new seed each round (drafts seldom match: adaptive drafting must stay near plain speed). Decode
speed is the daemon's eval_count / eval_duration. Prints a table, and writes it to
$OUT/bench_speed.md when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402, F401  (a CUDA build must load before numpy)

CODE = "\n".join(f"def scale_{i}(values):\n    return [v * {i} + {i * 3} for v in values]\n"
                 for i in range(24))
GREEDY = {"temperature": 0}
SAMPLED = {"temperature": 1.0, "top_k": 40, "top_p": 1.0}  # a new seed each round
STORY = "Write a long story about a lighthouse keeper who finds a message in a bottle."
# (prompt, sampling): where drafts should pay, where greedy text loops, where they seldom match
PROMPTS = {
    "repeat a code listing with one change":
        (f"Repeat this code exactly, but rename scale_5 to grow_5:\n\n{CODE}", GREEDY),
    "a story, greedy": (STORY, GREEDY),
    "a story, sampled at temperature 1 (drafts seldom match)": (STORY, SAMPLED),
}


def ask(url: str, prompt: str, n: int, mode: str, sampling: dict, seed: int = 0) -> dict:
    # /api/generate: templated when the model has a chat template, as given when it has none
    # (the synthetic models of the GPU machine).
    body = json.dumps({"model": "bench", "stream": False, "prompt": prompt,
                       "options": {**sampling, "seed": seed, "num_predict": n,
                                   "speculative": mode}})
    req = urllib.request.Request(url + "/api/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as resp:
        return json.loads(resp.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path)
    parser.add_argument("--tokens", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    from tests.daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    model = args.model
    if model is None:
        from scripts import fetch_test_models

        model = fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")
    lines = [f"Prompt lookup vs plain decode, {model.name}, {args.tokens} tokens, median of "
             f"{args.rounds} (drafts summed over them)", "",
             "| prompt | plain tok/s | lookup tok/s | speedup | drafted | accepted | "
             "acceptance |", "| --- | --- | --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory() as tmp:
        env = isolated_env(Path(tmp), LOCALLLM_NUM_PARALLEL="1")
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
        daemon = start_daemon(env)
        try:
            ask(daemon.url, "Hello", 8, "off", GREEDY)  # load
            for label, (prompt, sampling) in PROMPTS.items():
                plain, lookup, drafted, accepted = [], [], 0, 0
                for seed in range(args.rounds):  # interleaved: the machine's load hits both
                    for mode, rates in (("off", plain), ("lookup", lookup)):
                        r = ask(daemon.url, prompt, args.tokens, mode, sampling, seed)
                        rates.append(r["eval_count"] / (r["eval_duration"] / 1e9))
                        if mode == "lookup":
                            drafts = r.get("stats", {}).get("draft", {})
                            drafted += drafts.get("drafted", 0)
                            accepted += drafts.get("accepted", 0)
                p, q = statistics.median(plain), statistics.median(lookup)
                lines.append(f"| {label} | {p:.1f} | {q:.1f} | {q / p:.2f}x | {drafted} | "
                             f"{accepted} | {accepted / max(drafted, 1):.0%} |")
                print(lines[-1], flush=True)
        finally:
            daemon.stop()
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_speed.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
