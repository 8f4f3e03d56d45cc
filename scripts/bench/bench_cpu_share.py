#!/usr/bin/env python3
"""One model's one-token answers while another model reads a long prompt, on this machine's CPU:
with the daemon's runners sharing the cores (the default: each busy runner takes its plan's
share of the threads, scheduler._share_cpu) and without (LOCALLLM_CPU_SHARE=off: both at the
plan's threads, llama.cpp's threads of each meeting at barriers on cores the other holds).

    .venv/bin/python -m scripts.bench.bench_cpu_share [--rounds 5] [--words 600] [--every 0.25]

A real daemon on the test models: SmolLM2 reads a raw prompt of `--words` numbered words (a new
one each round, so nothing is reused; num_predict 1), and meanwhile Gemma 3 270M answers "hi"
with one token, every `--every` seconds. Per mode it prints Gemma's answer alone, the median and the
worst of its answers while SmolLM2 reads, and how long SmolLM2's prompt took. Other processes
on the machine count as load too: say what else ran when quoting the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        return json.loads(resp.read())


def one_token(url: str) -> float:
    started = time.monotonic()
    post(url + "/api/generate", {"model": "gemma", "prompt": "hi", "stream": False,
                                 "options": {"num_predict": 1}})
    return time.monotonic() - started


def run(mode: str, rounds: int, words: int, every: float, models: dict[str, Path]) -> dict:
    from conftest import import_models
    from tests.daemon_process import isolated_env, start_daemon

    with tempfile.TemporaryDirectory() as tmp:
        env = isolated_env(Path(tmp), LOCALLLM_CPU_SHARE=mode)
        import_models(env, models)
        daemon = start_daemon(env)
        try:
            for model, options in (("smollm2", {"num_ctx": 4096}), ("gemma", {})):
                post(daemon.url + "/api/generate", {"model": model, "prompt": "",
                                                    "keep_alive": "1h", "stream": False,
                                                    "options": options})
            alone = [one_token(daemon.url) for _ in range(5)]
            beside, reads = [], []
            for r in range(rounds):
                prompt = " ".join(f"r{r}w{i}" for i in range(words))
                took: dict[str, float] = {}

                def read(prompt: str = prompt, took: dict = took) -> None:
                    started = time.monotonic()
                    post(daemon.url + "/api/generate", {
                        "model": "smollm2", "prompt": prompt, "raw": True, "stream": False,
                        "options": {"num_predict": 1, "num_ctx": 4096}})
                    took["s"] = time.monotonic() - started

                reader = threading.Thread(target=read)
                reader.start()
                while reader.is_alive():
                    beside.append(one_token(daemon.url))
                    reader.join(every)  # a user's or an agent's pace, not a flood
                reader.join()
                if "s" not in took:
                    raise SystemExit("SmolLM2's prompt failed (see the traceback above)")
                reads.append(took["s"])
            threads = {m["name"]: m.get("threads_reason", "") for m in daemon.ps()}
        finally:
            daemon.stop()
    return {"mode": mode, "alone_s": round(statistics.median(alone), 3),
            "beside_median_s": round(statistics.median(beside), 3),
            "beside_worst_s": round(max(beside), 3), "answers_beside": len(beside),
            "prompt_read_s": round(statistics.median(reads), 2), "threads": threads}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--every", type=float, default=0.25,
                   help="seconds between the end of one of Gemma's answers and the next")
    p.add_argument("--words", type=int, default=600,
                   help="SmolLM2's prompt, in words (about 4 tokens each; within 4096)")
    args = p.parse_args()
    from scripts import fetch_test_models

    models = {"smollm2": fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf"),
              "gemma": fetch_test_models.ensure("gemma-3-270m-q4_k_m.gguf")}
    for mode in ("on", "off"):
        print(json.dumps(run(mode, args.rounds, args.words, args.every, models)), flush=True)


if __name__ == "__main__":
    main()
