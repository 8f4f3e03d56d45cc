#!/usr/bin/env python3
"""Decode speed of the default model through the daemon's streaming HTTP API vs llama-cpp-python
in one process, same model, same threads, same prompt, greedy. Prints both and the ratio.

    python scripts/bench_api.py [--tokens 256] [--rounds 3] [--model PATH]

The API figure is measured by the client: tokens received over the time from the first
streamed token to the last, so it includes the runner pipe, the daemon and HTTP. Target: >= 0.95.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "scripts"))

import checkout_imports  # noqa: E402

checkout_imports.bootstrap()
# A CUDA build of llama.cpp must load before numpy (gguf, the store) or the model load crashes.
import llama_cpp  # noqa: E402, F401

PROMPT = "Here is a long story about a lighthouse keeper and the sea. Once upon a time"


def direct_tps(model: Path, n_tokens: int, plan: dict) -> tuple[float, int]:
    """The binding's own loop, loaded with the plan the daemon chose (layers, KV, threads)."""
    from llama_cpp import Llama

    kv = {"f16": 1, "q8_0": 8, "q4_0": 2}
    llm = Llama(str(model), n_ctx=plan["context_length"], n_gpu_layers=plan["gpu_layers"],
                flash_attn=plan["flash_attn"], type_k=kv[plan["kv_type"]],
                type_v=kv[plan["kv_type"]], n_threads=plan["threads"],
                n_threads_batch=plan["threads"], verbose=False)
    tokens = llm.tokenize(PROMPT.encode())
    count, start = 0, None
    for token in llm.generate(tokens, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                              repeat_penalty=1.0):
        if start is None:
            start = time.perf_counter()  # first token: prompt done, decode timing starts
        if llm.token_eos() == token:
            break
        count += 1
        if count >= n_tokens:
            break
    elapsed = time.perf_counter() - start
    return (count - 1) / elapsed, count


def api_tps(url: str, n_tokens: int) -> tuple[float, int, float]:
    body = json.dumps({"model": "bench", "prompt": PROMPT, "raw": True, "stream": True,
                       "options": {"num_predict": n_tokens, "temperature": 0, "top_k": 1}})
    req = urllib.request.Request(url + "/api/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    first = last = None
    final = {}
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            data = json.loads(line)
            if data.get("done"):
                final = data
                break
            now = time.perf_counter()
            first = first or now
            last = now
    if first is None or final["eval_count"] < 2:
        raise SystemExit(f"the model stopped after {final['eval_count']} tokens; a synthetic "
                         f"model needs random weights (synth_gguf.py --fill random)")
    daemon_rate = final["eval_count"] / (final["eval_duration"] / 1e9)
    # Chunks may carry several tokens (the runner merges tokens faster than 40 a second):
    # count tokens, from the first chunk's arrival (one token) to the last chunk's.
    return (final["eval_count"] - 1) / (last - first), final["eval_count"], daemon_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path)
    args = parser.parse_args()

    from daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    if args.model:
        model = args.model
    else:
        import fetch_test_models

        model = fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        env = isolated_env(Path(tmp))
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
        daemon = start_daemon(env)
        try:
            api_tps(daemon.url, 16)  # load the model and warm up
            [plan] = daemon.get("/api/ps")["models"]
            print(f"daemon plan: {plan['processor']}, {plan['gpu_layers']} GPU layers, "
                  f"{plan['kv_type']} KV, flash attention {plan['flash_attn']}, "
                  f"{plan['threads']} threads, context {plan['context_length']}")
            direct, api, reported = [], [], []
            for _ in range(args.rounds):  # interleaved, so drift hits both alike
                d, n_direct = direct_tps(model, args.tokens, plan)
                a, n_api, r = api_tps(daemon.url, args.tokens)
                direct.append(d)
                api.append(a)
                reported.append(r)
        finally:
            daemon.stop()
    d, a, r = statistics.median(direct), statistics.median(api), statistics.median(reported)
    print(f"model: {model.name}  tokens: {args.tokens}  rounds: {args.rounds}")
    print(f"llama-cpp-python in-process (Llama.generate): {d:8.1f} tok/s  ({n_direct} tokens)")
    print(f"daemon, streamed over HTTP (client-side):      {a:8.1f} tok/s  ({n_api} tokens)")
    print(f"daemon, its own eval rate (eval_count/eval_duration): {r:8.1f} tok/s")
    print(f"ratio API / direct: {a / d:.3f}  (target >= 0.95)")


if __name__ == "__main__":
    main()
