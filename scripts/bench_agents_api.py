#!/usr/bin/env python3
"""Time to first token and decode speed through /v1/messages and /v1/responses beside /api/chat,
and an agent session's second-turn time to first token after a side request, in one run.

    python scripts/bench_agents_api.py                       # CPU: the default test model
    python scripts/bench_agents_api.py --model M.gguf [--model M2.gguf] [--agent-tokens 20000]

Per model: one daemon; the three wire formats take turns within each round, each on a fresh
prompt (a nonce first, so no prefix is reused), greedy, no drafting. TTFT is the client's time
from sending to the first streamed text; decode is (tokens - 1) over the time from the first to
the last text chunk. The agent case sends a system prompt of about --agent-tokens tokens through
/v1/messages, then a side request (another prompt: a title), then the second turn; it reports
both turns' TTFT and their ratio, with num_parallel 1 and 4. A synthetic model has no chat
template: a ChatML one is added with /api/create. Prints a table and writes $OUT/bench_agents.md.
"""

from __future__ import annotations

import argparse
import json
import os
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

CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + "
          "message.content + '<|im_end|>\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CTX = 32768
# The same sampling on every wire: greedy, no drafting, the same context (no reload between).
SAMPLING = {"temperature": 0, "top_k": 1, "speculative": "off", "num_ctx": CTX}


def post(url: str, path: str, body: dict):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=1800)


def prompt_text(seed: int, words: int = 300) -> str:
    return f"[{seed}] " + " ".join(f"note{(seed * 7 + i) % 997}" for i in range(words))


# ---- one streamed answer per wire: (ttft s, decode tok/s, tokens) --------------------------
def ollama_chat(url: str, system: str, user: str, n: int):
    sent = time.perf_counter()
    first = last = 0.0
    count = 0
    with post(url, "/api/chat", {"model": "chat", "stream": True, "options": {
            "num_predict": n, **SAMPLING},
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": user}]}) as resp:
        for line in resp:
            data = json.loads(line)
            if data.get("done"):
                count = data["eval_count"]
                break
            if data["message"].get("content"):
                last = time.perf_counter()
                first = first or last
    return first - sent, first, last, count


def messages(url: str, system: str, user, n: int, history: list | None = None):
    sent = time.perf_counter()
    first = last = 0.0
    count, text = 0, []
    body = {"model": "chat", "max_tokens": n, "stream": True, "system": system,
            "messages": (history or []) + [{"role": "user", "content": user}], **SAMPLING}
    with post(url, "/v1/messages", body) as resp:
        for raw in resp:
            if not raw.startswith(b"data: "):
                continue
            data = json.loads(raw[6:])
            if data["type"] == "content_block_delta" and data["delta"].get("text"):
                last = time.perf_counter()
                first = first or last
                text.append(data["delta"]["text"])
            elif data["type"] == "message_delta":
                count = data["usage"]["output_tokens"]
                usage = data["usage"]
            elif data["type"] == "error":
                raise SystemExit(f"/v1/messages: {data['error']['message']}")
    return first - sent, first, last, count, "".join(text), usage


def responses(url: str, system: str, user: str, n: int):
    sent = time.perf_counter()
    first = last = 0.0
    count = 0
    with post(url, "/v1/responses", {"model": "chat", "max_output_tokens": n, "stream": True,
                                     "instructions": system, "input": user, "store": False,
                                     **SAMPLING}) as resp:
        for raw in resp:
            if not raw.startswith(b"data: "):
                continue
            data = json.loads(raw[6:])
            if data["type"] == "response.output_text.delta" and data["delta"]:
                last = time.perf_counter()
                first = first or last
            elif data["type"] == "response.completed":
                count = data["response"]["usage"]["output_tokens"]
    return first - sent, first, last, count


WIRES = {"/api/chat": ollama_chat, "/v1/messages": lambda *a: messages(*a)[:4],
         "/v1/responses": responses}


def wires(url: str, n: int, rounds: int) -> dict:
    ttft: dict = {w: [] for w in WIRES}
    decode: dict = {w: [] for w in WIRES}
    for r in range(rounds + 1):
        for i, (wire, run) in enumerate(WIRES.items()):
            wait, first, last, count = run(url, "You are a helpful assistant.",
                                           prompt_text(r * 10 + i), n)
            if r == 0:
                continue  # warm-up round
            if count < 2 or last <= first:
                raise SystemExit(f"{wire}: the model stopped after {count} tokens (a synthetic "
                                 f"model needs random weights: synth_gguf.py --fill random)")
            ttft[wire].append(wait)
            decode[wire].append((count - 1) / (last - first))
    return {w: (statistics.median(ttft[w]), statistics.median(decode[w])) for w in WIRES}


def agent_prompt(url: str, tokens: int) -> str:
    """A system prompt of about `tokens` tokens, sized with count_tokens."""
    words = 2000
    for _ in range(3):
        text = prompt_text(12345, words)
        with post(url, "/v1/messages/count_tokens", {
                "model": "chat", "system": text, "num_ctx": CTX,
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
            count = json.loads(resp.read())["input_tokens"]
        words = max(1, int(words * tokens / count))
    return prompt_text(12345, words)


def agent_session(url: str, tokens: int) -> dict:
    system = agent_prompt(url, tokens)
    first = messages(url, system, "Start the task.", 16)
    side = messages(url, "Write a five-word title for this chat.", "Start the task.", 8)
    history = [{"role": "user", "content": "Start the task."},
               {"role": "assistant", "content": first[4]}]
    second = messages(url, system, "Continue.", 16, history)
    return {"turn1_ttft": first[0], "turn2_ttft": second[0], "side_ttft": side[0],
            "turn2_cached": second[5]["cache_read_input_tokens"],
            "turn2_prompt": second[5]["cache_read_input_tokens"] + second[5]["input_tokens"]}


def daemon_for(model: Path, tmp: Path, parallel: int):
    from daemon_process import isolated_env, start_daemon

    from localllm.modelstore.store import ModelStore

    env = isolated_env(tmp, LOCALLLM_NUM_PARALLEL=str(parallel))
    ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models").import_gguf(model, "bench")
    daemon = start_daemon(env)
    with post(daemon.url, "/api/create", {"model": "chat", "from": "bench",
                                          "template": CHATML, "stream": False}) as resp:
        resp.read()
    return daemon


def bench_model(model: Path, n: int, rounds: int, agent_tokens: int) -> dict:
    row: dict = {"model": model.name, "agent": {}}
    for parallel in (1, 4):
        with tempfile.TemporaryDirectory() as tmp:
            daemon = daemon_for(model, Path(tmp), parallel)
            try:
                if parallel == 1:
                    row["wires"] = wires(daemon.url, n, rounds)
                row["agent"][parallel] = agent_session(daemon.url, agent_tokens)
            finally:
                daemon.stop()
    return row


def table(rows: list[dict], n: int, agent_tokens: int) -> str:
    lines = [f"Streamed, greedy, {n} tokens, client-side medians; ratios against /api/chat", "",
             "| model | wire | TTFT ms | decode tok/s | TTFT ratio | decode ratio |",
             "|" + " --- |" * 6]
    for r in rows:
        base_ttft, base_decode = r["wires"]["/api/chat"]
        for wire, (ttft, decode) in r["wires"].items():
            lines.append(f"| {r['model']} | {wire} | {ttft * 1000:.0f} | {decode:.1f} | "
                         f"{ttft / base_ttft:.3f} | {decode / base_decode:.3f} |")
    lines += ["", f"Agent session through /v1/messages: a {agent_tokens}-token system prompt, "
              "turn 1, a side request, turn 2", "",
              "| model | num_parallel | turn 1 TTFT ms | side TTFT ms | turn 2 TTFT ms | "
              "turn 2 / turn 1 | turn 2 cached / prompt |", "|" + " --- |" * 7]
    for r in rows:
        for parallel, a in r["agent"].items():
            lines.append(f"| {r['model']} | {parallel} | {a['turn1_ttft'] * 1000:.0f} | "
                         f"{a['side_ttft'] * 1000:.0f} | {a['turn2_ttft'] * 1000:.0f} | "
                         f"{a['turn2_ttft'] / a['turn1_ttft']:.3f} | "
                         f"{a['turn2_cached']} / {a['turn2_prompt']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--agent-tokens", type=int, default=20000)
    parser.add_argument("--model", type=Path, action="append")
    args = parser.parse_args()
    models = args.model
    if not models:
        import fetch_test_models

        models = [fetch_test_models.ensure("SmolLM2-135M-Instruct.Q4_1.gguf")]
    rows = []
    for model in models:
        rows.append(bench_model(model.resolve(), args.tokens, args.rounds, args.agent_tokens))
        print(table(rows[-1:], args.tokens, args.agent_tokens), flush=True)
    text = table(rows, args.tokens, args.agent_tokens)
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_agents.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
