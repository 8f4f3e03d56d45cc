#!/usr/bin/env python3
"""Decode speed through localllm's streaming API beside llama.cpp's own tools, in one run.

    python -m scripts.bench.bench_api                     # CPU: the default model, 1 and 4 streams
    python -m scripts.bench.bench_api --model M.gguf [--model M2.gguf ...] [--tokens 256]
    python -m scripts.bench.bench_api --routes [--tokens 128]  # one stream through each API route

For each model: llama-bench `tg` (when llama-bench is on PATH), llama-server (when on PATH) and
the localllm daemon, each greedy and with Ollama's default sampling (temperature 0.8, top_k 40,
top_p 0.9, repeat_penalty 1.1), one stream; and the aggregate of 4 concurrent streams
(llama-server `-np 4`, the daemon with num_parallel 4). Speeds are measured by the client:
tokens over the time from the first streamed chunk to the last (one stream), or over the wall
time of all four requests (aggregate). Prints a table and writes it to $OUT/bench_api.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# A CUDA build of llama.cpp must load before numpy (gguf, the store) or the model load crashes.
import llama_cpp  # noqa: E402, F401

PROMPT = "Here is a long story about a lighthouse keeper and the sea. Once upon a time"
GREEDY = {"temperature": 0, "top_k": 1, "repeat_penalty": 1.0}
OLLAMA_DEFAULT = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1,
                  "repeat_last_n": 64, "min_p": 0.0}


# ---- clients -------------------------------------------------------------------------------
def stream_localllm(url: str, n: int, sampling: dict) -> tuple[int, float, float]:
    """(tokens, first chunk time, last chunk time) of one streamed /api/generate."""
    body = json.dumps({"model": "bench", "prompt": PROMPT, "raw": True, "stream": True,
                       # no drafting: llama-server and llama-bench decode plainly, and the
                       # synthetic models' looping text would flatter prompt lookup
                       "options": {"num_predict": n, "seed": 1, "speculative": "off",
                                   **sampling}})
    req = urllib.request.Request(url + "/api/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    first = last = 0.0
    count = 0
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:  # parsed only at the end: the client shares the machine's cores
            if b'"done": true' in line:
                count = json.loads(line)["eval_count"]
                break
            if b'"response": ""' not in line:
                last = time.perf_counter()
                first = first or last
    return count, first, last


def stream_server(url: str, n: int, sampling: dict) -> tuple[int, float, float]:
    """The same against llama-server's /completion (SSE, a token an event)."""
    params = {"prompt": PROMPT, "n_predict": n, "stream": True, "seed": 1, "cache_prompt": True,
              "temperature": sampling["temperature"], "top_k": sampling["top_k"],
              "top_p": sampling.get("top_p", 1.0), "min_p": sampling.get("min_p", 0.0),
              "repeat_penalty": sampling["repeat_penalty"],
              "repeat_last_n": sampling.get("repeat_last_n", 64)}
    req = urllib.request.Request(url + "/completion", data=json.dumps(params).encode(),
                                 headers={"Content-Type": "application/json"})
    first = last = 0.0
    count = 0
    with urllib.request.urlopen(req, timeout=900) as resp:
        for raw in resp:
            if not raw.startswith(b"data: "):
                continue
            if b'"stop":true' in raw or b'"stop": true' in raw:
                count = json.loads(raw[6:]).get("tokens_predicted", count)
                break
            if b'"content":""' not in raw and b'"content": ""' not in raw:
                last = time.perf_counter()
                first = first or last
    return count, first, last


def one_stream(stream, url: str, n: int, sampling: dict, rounds: int) -> float:
    rates = []
    for _ in range(rounds):
        count, first, last = stream(url, n, sampling)
        if count < 2 or last <= first:
            raise SystemExit(f"{url}: the model stopped after {count} tokens (a synthetic model "
                             f"needs random weights: synth_gguf.py --fill random)")
        rates.append((count - 1) / (last - first))
    return statistics.median(rates)


def concurrent(stream, url: str, n: int, sampling: dict, streams: int = 4) -> float:
    """Aggregate tok/s of `streams` requests sent together (wall time of all of them)."""
    counts: list[int] = []

    def run() -> None:
        counts.append(stream(url, n, sampling)[0])

    threads = [threading.Thread(target=run) for _ in range(streams)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


# ---- each route ----------------------------------------------------------------------------
STORY = "Write a long story about a lighthouse keeper and the sea."


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# route -> (the body of a greedy streamed request of n tokens, the bytes that mark a streamed
# line carrying answer text, the line's text before the final token count, and where that
# count is in it). The chat routes ask for a story: greedy decode may stop early, which is the
# same before and after a change.
ROUTES = {
    "/api/generate": (lambda n: {"prompt": PROMPT, "raw": True, "options": {
        "num_predict": n, **GREEDY, "seed": 1, "speculative": "off"}},
        b'"response": "', b'"done": true', ("eval_count",)),
    "/api/chat": (lambda n: {"messages": _chat(STORY), "options": {
        "num_predict": n, **GREEDY, "seed": 1, "speculative": "off"}},
        b'"content": "', b'"done": true', ("eval_count",)),
    "/v1/completions": (lambda n: {
        "prompt": PROMPT, "max_tokens": n, "temperature": 0, "top_k": 1, "seed": 1,
        "speculative": "off", "stream_options": {"include_usage": True}},
        b'"text": "', b'"usage": {', ("usage", "completion_tokens")),
    "/v1/chat/completions": (lambda n: {
        "messages": _chat(STORY), "max_tokens": n, "temperature": 0, "top_k": 1, "seed": 1,
        "speculative": "off", "stream_options": {"include_usage": True}},
        b'"content": "', b'"usage": {', ("usage", "completion_tokens")),
    "/v1/messages": (lambda n: {"messages": _chat(STORY), "max_tokens": n, "temperature": 0,
                                "top_k": 1, "speculative": "off"},
                     b'"text_delta"', b'"message_delta"', ("usage", "output_tokens")),
    "/v1/responses": (lambda n: {"input": STORY, "max_output_tokens": n, "temperature": 0,
                                 "top_k": 1, "speculative": "off"},
                      b'"response.output_text.delta"', b'"response.completed"',
                      ("response", "usage", "output_tokens")),
}


def stream_route(url: str, route: str, n: int) -> tuple[int, float, float]:
    """(tokens, first text chunk time, last text chunk time) of one stream on `route`."""
    make, marker, final, where = ROUTES[route]
    body = json.dumps({"model": "bench", "stream": True, **make(n)})
    req = urllib.request.Request(url + route, data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    first = last = 0.0
    count = 0
    with urllib.request.urlopen(req, timeout=900) as resp:
        for line in resp:  # parsed only at the end: the client shares the machine's cores
            if final in line:
                doc = json.loads(line.removeprefix(b"data: "))
                for key in where:
                    doc = doc[key]
                count = doc
                break
            if marker in line and b'": ""' not in line:
                last = time.perf_counter()
                first = first or last
    return count, first, last


def route_daemon(root: Path, model: Path, python: str = sys.executable):
    """A daemon of the checkout `python` has installed, in its own dirs under `root`, with
    `model` stored as "bench", loaded and warmed up."""
    from tests.daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    env = isolated_env(root, LOCALLLM_CONTEXT_POLICY="fixed")
    ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
    daemon = start_daemon(env, python=python)
    stream_route(daemon.url, "/api/generate", 16)
    return daemon


def bench_routes(model: Path, n: int, rounds: int) -> str:
    """Decode tok/s of one greedy stream through each route (median of `rounds`)."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        daemon = route_daemon(Path(tmp), model)
        try:
            for route in ROUTES:
                rates, counts = [], []
                for _ in range(rounds):
                    count, first, last = stream_route(daemon.url, route, n)
                    counts.append(count)
                    rates.append((count - 1) / (last - first) if last > first else 0.0)
                rows.append(f"| {route} | {min(counts)} | {statistics.median(rates):.1f} |")
        finally:
            daemon.stop()
    return "\n".join([f"Decode through each route, {model.name}, one greedy stream, up to {n} "
                      f"tokens (tok/s from first text to last, client-side, median of {rounds})",
                      "", "| route | tokens | tok/s |", "| --- | --- | --- |", *rows])


def bench_routes_versus(model: Path, n: int, rounds: int, other: Path) -> str:
    """Decode tok/s through each route of this checkout's daemon and another checkout's,
    both up at once and asked in turn (which goes first alternates each round), so that the
    machine's drift between runs falls on both alike: per route the median of each side and
    the median of the per-round ratios (this / other)."""
    pythons = {"this": sys.executable, "other": str(other / ".venv" / "bin" / "python")}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        daemons = {}
        try:
            for side, python in pythons.items():
                daemons[side] = route_daemon(Path(tmp) / side, model, python)
            for route in ROUTES:
                rates: dict[str, list[float]] = {"this": [], "other": []}
                for r in range(rounds):
                    for side in (("this", "other") if r % 2 else ("other", "this")):
                        count, first, last = stream_route(daemons[side].url, route, n)
                        rates[side].append((count - 1) / (last - first) if last > first else 0)
                ratios = [a / b for a, b in zip(rates["this"], rates["other"], strict=True) if b]
                rows.append(f"| {route} | {statistics.median(rates['other']):.1f} | "
                            f"{statistics.median(rates['this']):.1f} | "
                            f"{statistics.median(ratios):.3f} |")
        finally:
            for daemon in daemons.values():
                daemon.stop()
    return "\n".join([f"Decode through each route, {model.name}, one greedy stream, up to {n} "
                      f"tokens, {rounds} rounds asked in turn of {other} (other) and this "
                      "checkout (this)", "",
                      "| route | other tok/s | this tok/s | median ratio this/other |",
                      "| --- | --- | --- | --- |", *rows])


# ---- servers ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not come up")


def llama_server(model: Path, plan: dict, parallel: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = ["llama-server", "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
            "-ngl", str(plan["gpu_layers"]), "-c", str(plan["context_length"] * parallel),
            "-np", str(parallel), "-t", str(plan["threads"]), "-fa",
            "on" if plan["flash_attn"] else "off", "-ctk", plan["kv_type"], "-ctv",
            plan["kv_type"], "--no-warmup"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_http(url, proc)
    return proc, url


def llama_bench(model: Path, plan: dict, n: int) -> float | None:
    if not shutil.which("llama-bench"):
        return None
    out = subprocess.run(
        ["llama-bench", "-m", str(model), "-p", "0", "-n", str(n), "-r", "3", "-o", "json",
         "-ngl", str(plan["gpu_layers"]), "-t", str(plan["threads"]),
         "-fa", "1" if plan["flash_attn"] else "0", "-ctk", plan["kv_type"], "-ctv",
         plan["kv_type"]], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        print(out.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(out.stdout)[0]["avg_ts"]


# ---- one model -------------------------------------------------------------------------
def bench_model(model: Path, n: int, rounds: int) -> dict:
    from tests.daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    row: dict = {"model": model.name}
    with tempfile.TemporaryDirectory() as tmp:
        # A fixed 4096-token context per slot: the same KV for llama-server, and loads that
        # do not allocate 128K-token caches.
        env = isolated_env(Path(tmp), LOCALLLM_NUM_PARALLEL="4", LOCALLLM_CONTEXT_POLICY="fixed")
        ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
        daemon = start_daemon(env)
        try:
            stream_localllm(daemon.url, 16, GREEDY)  # load and warm up
            [plan] = daemon.get("/api/ps")["models"]
            row["plan"] = (f"{plan['processor']}, {plan['gpu_layers']} layers, {plan['kv_type']} "
                           f"KV, FA {plan['flash_attn']}, {plan['threads']} threads, "
                           f"ctx {plan['context_length']} x {plan['num_parallel']} slots")
            row["ours_greedy"] = one_stream(stream_localllm, daemon.url, n, GREEDY, rounds)
            row["ours_default"] = one_stream(stream_localllm, daemon.url, n, OLLAMA_DEFAULT,
                                             rounds)
            row["ours_x4"] = concurrent(stream_localllm, daemon.url, n, GREEDY)
        finally:
            daemon.stop()
    row["bench_tg"] = llama_bench(model, plan, n)
    if shutil.which("llama-server"):
        proc, url = llama_server(model, plan, 1)
        try:
            stream_server(url, 16, GREEDY)
            row["server_greedy"] = one_stream(stream_server, url, n, GREEDY, rounds)
            row["server_default"] = one_stream(stream_server, url, n, OLLAMA_DEFAULT, rounds)
        finally:
            proc.terminate()
            proc.wait()
        proc, url = llama_server(model, plan, 4)
        try:
            stream_server(url, 16, GREEDY)
            row["server_x4"] = concurrent(stream_server, url, n, GREEDY)
        finally:
            proc.terminate()
            proc.wait()
    # Aggregate of 4 streams over one stream, through our API.
    row["ours_x4_over_1"] = row["ours_x4"] / row["ours_greedy"]
    return row


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


def ratio(a: float | None, b: float | None) -> str:
    return "" if not a or not b else f"{a / b:.2f}"


def table(rows: list[dict], n: int) -> str:
    lines = [f"Decode tok/s, {n} tokens, client-side (median of rounds; x4 = aggregate of 4 "
             f"concurrent streams)", "",
             "| model | llama-bench tg | server greedy | ours greedy | ours/bench | ours/server "
             "| server default | ours default | ours/server | server x4 | ours x4 | ours x4/server"
             " x4 | ours x4/ours x1 |",
             "|" + " --- |" * 14]
    for r in rows:
        lines.append(
            f"| {r['model']} | {fmt(r.get('bench_tg'))} | {fmt(r.get('server_greedy'))} | "
            f"{fmt(r['ours_greedy'])} | {ratio(r['ours_greedy'], r.get('bench_tg'))} | "
            f"{ratio(r['ours_greedy'], r.get('server_greedy'))} | "
            f"{fmt(r.get('server_default'))} | {fmt(r['ours_default'])} | "
            f"{ratio(r['ours_default'], r.get('server_default'))} | {fmt(r.get('server_x4'))} | "
            f"{fmt(r['ours_x4'])} | {ratio(r['ours_x4'], r.get('server_x4'))} | "
            f"{r['ours_x4_over_1']:.2f} |")
    lines += [""] + [f"- {r['model']}: {r['plan']}" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", type=Path, action="append")
    parser.add_argument("--routes", action="store_true",
                        help="one greedy stream through each API route instead")
    parser.add_argument("--versus", type=Path, metavar="CHECKOUT",
                        help="with --routes: against another checkout's daemon (its .venv), "
                             "asked in turn")
    args = parser.parse_args()
    models = args.model
    if not models:
        from scripts import fetch_test_models

        models = [fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")]
    if args.routes:
        for model in models:
            print(bench_routes_versus(model.resolve(), args.tokens, args.rounds, args.versus)
                  if args.versus else bench_routes(model.resolve(), args.tokens, args.rounds),
                  flush=True)
        return
    rows = []
    for model in models:
        rows.append(bench_model(model.resolve(), args.tokens, args.rounds))
        print(table(rows[-1:], args.tokens), flush=True)
    text = table(rows, args.tokens)
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_api.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
