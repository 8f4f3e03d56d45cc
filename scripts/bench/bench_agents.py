#!/usr/bin/env python3
"""What agents get from the daemon: decode speed and time to first token through each API,
and the second turn of a long agent prompt after a side request.

    python -m scripts.bench.bench_agents                      # llama-8b and dense-27b, synthetic
    python -m scripts.bench.bench_agents --shape llama-8b --agent-tokens 20000 --tokens 128
    python -m scripts.bench.bench_agents --gguf M.gguf --agent-tokens 1500   # a model file

For each shape (a synthetic Q4_0 GGUF from synth_gguf.py, random weights, given a chat
template through /api/create): the same short chat streamed through /api/chat,
/v1/chat/completions, /v1/messages and /v1/responses (a route the daemon lacks shows "404"):
time to first token and decode tok/s (tokens after the first over the time from the first to
the last streamed chunk), medians over rounds. Then an agent session with about
`--agent-tokens` of system prompt and tools (tests/agent_replay.py's shape) through
/v1/chat/completions, with one slot and with two: turn 1 (cold), a title request with another
prompt, turn 2 (the history plus a tool result): turn 2's TTFT as a share of turn 1's (target
below 5%), and the runner's own figures for saving and restoring the prompt. Prints a table,
and writes it to $OUT/bench_agents.md when OUT is set.

On the GPU machine: `source .device-carry/on-device.sh` first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402, F401  (a CUDA build must load before numpy)

from tests.agent_replay import (  # noqa: E402
    Message,
    Request,
    Session,
    ToolCall,
    openai_messages,
    system_prompt,
    tool_result,
)
from tests.chat_models import QWEN_TOOL_TEMPLATE  # noqa: E402

QUESTION = "Write a long story about a lighthouse keeper who finds a message in a bottle."
APIS = ("/api/chat", "/v1/chat/completions", "/v1/messages", "/v1/responses")


# ---- one streamed request per API: (ttft s, decode tok/s) or "404" --------------------------
def _post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Authorization": "Bearer bench",
        "anthropic-version": "2023-06-01"})


def _events(resp, sse: bool):
    """Each streamed JSON object (NDJSON lines, or SSE `data:` lines)."""
    for raw in resp:
        line = raw.strip()
        if not line:
            continue
        if sse:
            if not line.startswith(b"data:"):
                continue
            line = line[5:].strip()
            if line == b"[DONE]":
                return
        yield json.loads(line)


def stream_once(base: str, api: str, model: str, n: int) -> tuple[float, float] | str:
    messages = [{"role": "user", "content": QUESTION}]
    if api == "/api/chat":
        body = {"model": model, "messages": messages, "stream": True,
                "options": {"num_predict": n, "temperature": 0, "speculative": "off"}}
    elif api == "/v1/chat/completions":
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": n,
                "temperature": 0, "stream_options": {"include_usage": True}}
    elif api == "/v1/messages":
        body = {"model": model, "messages": messages, "stream": True, "max_tokens": n,
                "temperature": 0}
    else:
        body = {"model": model, "input": QUESTION, "stream": True, "max_output_tokens": n,
                "temperature": 0}
    # Plain decode on every route, as /api/chat asks: the same drafting on each (none), so the
    # routes' own cost is what differs.
    body.setdefault("speculative", "off")
    sent = time.perf_counter()
    first = last = 0.0
    tokens = 0
    try:
        with urllib.request.urlopen(_post(base + api, body), timeout=900) as resp:
            for event in _events(resp, sse=api != "/api/chat"):
                text, count = _text_and_count(api, event)
                if text:
                    last = time.perf_counter()
                    first = first or last
                tokens = count or tokens
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return "404"
        raise
    if not first or tokens < 2:
        return "no answer"
    return first - sent, (tokens - 1) / max(last - first, 1e-9)


def _text_and_count(api: str, e: dict) -> tuple[str, int]:
    if api == "/api/chat":
        return e.get("message", {}).get("content", ""), e.get("eval_count", 0)
    if api == "/v1/chat/completions":
        text = "".join((c.get("delta") or {}).get("content") or "" for c in e.get("choices", []))
        return text, (e.get("usage") or {}).get("completion_tokens", 0)
    if api == "/v1/messages":
        if e.get("type") == "content_block_delta":
            return e["delta"].get("text", ""), 0
        return "", (e.get("usage") or {}).get("output_tokens", 0)
    if e.get("type") == "response.output_text.delta":
        return e.get("delta", ""), 0
    if e.get("type") == "response.completed":
        return "", ((e.get("response") or {}).get("usage") or {}).get("output_tokens", 0)
    return "", 0


def api_rows(base: str, model: str, n: int, rounds: int) -> dict[str, str]:
    out = {}
    for api in APIS:
        results = [stream_once(base, api, model, n) for _ in range(rounds + 1)][1:]  # warm
        if any(isinstance(r, str) for r in results):
            out[api] = next(r for r in results if isinstance(r, str))
            continue
        ttft = statistics.median(r[0] for r in results) * 1e3
        tps = statistics.median(r[1] for r in results)
        out[api] = f"{ttft:.0f} ms, {tps:.1f} tok/s"
    return out


# ---- the agent session: turn 2's TTFT after a side request ---------------------------------
def chat_ttft(base: str, model: str, request: Request) -> tuple[float, dict]:
    body = {"model": model, "messages": openai_messages(request), "stream": True,
            "max_tokens": request.max_tokens, "temperature": 0,
            "stream_options": {"include_usage": True}}
    if request.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in request.tools]
    sent = time.perf_counter()
    first, text, usage = 0.0, [], {}
    try:
        r = urllib.request.urlopen(_post(base + "/v1/chat/completions", body), timeout=900)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"/v1/chat/completions: {e.code} {e.read().decode()[:300]}") from None
    with r:
        for event in _events(r, sse=True):
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece or (choice.get("delta") or {}).get("tool_calls"):
                    first = first or time.perf_counter()
                text.append(piece)
            usage = event.get("usage") or usage
    return (first or time.perf_counter()) - sent, {"text": "".join(text), **usage}


def agent_session(base: str, model: str, words: int) -> dict:
    session = Session(system=system_prompt(words), answer_tokens=16)
    history = (Message("user", session.first_message),)
    t1, first = chat_ttft(base, model, Request(session.system, session.tools, history, 16))
    chat_ttft(base, model, session.title_request())
    call = ToolCall("call_0", "Read", {"path": "src/module_0"})
    history += (Message("assistant", first["text"], call), Message("tool", tool_result(0), call))
    t2, second = chat_ttft(base, model, Request(session.system, session.tools, history, 16))
    cached = (second.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt": first.get("prompt_tokens", 0), "turn1_ms": t1 * 1e3,
            "turn2_ms": t2 * 1e3, "share": t2 / t1 if t1 else 0.0,
            "turn2_prompt": second.get("prompt_tokens", 0), "turn2_cached": cached}


def words_for(base: str, model: str, tokens: int) -> int:
    """Words of system prompt that make about `tokens` of prompt with the tools."""
    sample = 300
    session = Session(system=system_prompt(sample))
    request = Request(session.system, session.tools, (Message("user", "hi"),), 1)
    _, usage = chat_ttft(base, model, request)
    tools_only = Session(system="x")
    _, bare = chat_ttft(base, model, Request(tools_only.system, tools_only.tools,
                                             (Message("user", "hi"),), 1))
    per_word = max((usage["prompt_tokens"] - bare["prompt_tokens"]) / sample, 0.1)
    return int(max(100, tokens - bare["prompt_tokens"]) / per_word)


# ---- one shape ------------------------------------------------------------------------------
def start(tmp: Path, gguf: Path, num_parallel: int, n_ctx: int):
    from tests.daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    env = isolated_env(tmp / f"np{num_parallel}", LOCALLLM_NUM_PARALLEL=str(num_parallel),
                       LOCALLLM_CONTEXT_POLICY="fixed", LOCALLLM_CONTEXT_LENGTH=str(n_ctx))
    ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(gguf, "base")
    daemon = start_daemon(env)
    req = _post(daemon.url + "/api/create", {"model": "bench", "from": "base",
                                              "template": QWEN_TOOL_TEMPLATE, "stream": False})
    urllib.request.urlopen(req, timeout=120).read()
    return daemon


def runner_cache_lines(daemon) -> list[str]:
    log = Path(daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "runner.log"
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [re.sub(r"^runner \d+ INFO ", "", ln) for ln in lines if "prompt cache:" in ln]


def bench_shape(shape: str, tmp: Path, n: int, rounds: int, agent_tokens: int,
                tiny: bool = False, given: Path | None = None) -> list[str]:
    started = time.perf_counter()
    if given is not None:
        gguf = given
        lines = [f"## {given.name} ({gguf.stat().st_size / 2**30:.2f} GiB)", ""]
    else:
        gguf = tmp / f"{shape}.gguf"
        subprocess.run([sys.executable, "-m", "scripts.synth_gguf", shape,
                        str(gguf), "--type", "Q4_0", "--fill", "random",
                        *(["--tiny"] if tiny else [])], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        lines = [f"## {shape} (synthetic Q4_0, {gguf.stat().st_size / 2**30:.1f} GiB, written "
                 f"in {time.perf_counter() - started:.0f} s)", ""]
    n_ctx = max(8192, agent_tokens + 4096)
    daemon = start(tmp, gguf, 1, n_ctx)
    try:
        rows = api_rows(daemon.url, "bench", n, rounds)
        [plan] = daemon.get("/api/ps")["models"]
        lines += [f"plan: {plan['processor']}, {plan['gpu_layers']} layers, {plan['kv_type']} "
                  f"KV, ctx {plan['context_length']} x {plan['num_parallel']}", "",
                  f"| API | TTFT, decode (median of {rounds}) | vs /api/chat decode |",
                  "| --- | --- | --- |"]
        base_tps = _tps(rows["/api/chat"])
        for api, value in rows.items():
            tps = _tps(value)
            rel = f"{tps / base_tps * 100:.1f}%" if tps and base_tps else "-"
            lines.append(f"| {api} | {value} | {rel} |")
        words = words_for(daemon.url, "bench", agent_tokens)
        sessions = {1: agent_session(daemon.url, "bench", words)}
        cache_log = runner_cache_lines(daemon)
    finally:
        daemon.stop()
    daemon = start(tmp, gguf, 2, n_ctx)
    try:
        sessions[2] = agent_session(daemon.url, "bench", words)
    finally:
        daemon.stop()
    lines += ["", "| agent session | prompt | turn 1 TTFT | turn 2 TTFT | turn 2 / turn 1 | "
              "turn 2 cached |", "| --- | --- | --- | --- | --- | --- |"]
    for slots, s in sessions.items():
        lines.append(f"| {slots} slot{'s' if slots > 1 else ''} | {s['prompt']} | "
                     f"{s['turn1_ms']:.0f} ms | {s['turn2_ms']:.0f} ms | "
                     f"{s['share'] * 100:.1f}% | {s['turn2_cached']} of {s['turn2_prompt']} |")
    lines += ["", "runner (1 slot): " + ("; ".join(cache_log) or "no prompt cache lines"), ""]
    if given is None:
        gguf.unlink()
    return lines


def _tps(value: str) -> float:
    m = re.search(r"([\d.]+) tok/s", value)
    return float(m.group(1)) if m else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", action="append",
                        help="synth_gguf.py shapes (default: llama-8b and dense-27b)")
    parser.add_argument("--tokens", type=int, default=128, help="answer tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agent-tokens", type=int, default=20000)
    parser.add_argument("--tiny", action="store_true",
                        help="toy dimensions of each shape (a quick check of the script)")
    parser.add_argument("--gguf", type=Path, action="append",
                        help="bench this model file instead of synthetic shapes")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the synthetic models go (default: a temp dir)")
    args = parser.parse_args()
    out = ["# bench_agents", ""]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for given in args.gguf or []:
            out += bench_shape(given.stem, Path(tmp), args.tokens, args.rounds,
                               args.agent_tokens, given=given)
            print("\n".join(out), flush=True)
        for shape in args.shape or ([] if args.gguf else ["llama-8b", "dense-27b"]):
            out += bench_shape(shape, Path(tmp), args.tokens, args.rounds, args.agent_tokens,
                               args.tiny)
            print("\n".join(out), flush=True)
    text = "\n".join(out)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_agents.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
