#!/usr/bin/env python3
"""Recorded agent sessions replayed through the daemon and through llama-server at the same
budget: wall time per session and tokens read per turn.

    python -m scripts.bench.bench_replay --shape qwen3-30b-a3b --budget 12      # GPU machine
    python -m scripts.bench.bench_replay --tiny --systems ours                  # a CPU check

A session starts from a real CLI's recorded first request (cli/agent_requests/: Claude Code's
system prompt and 12 tools, Codex's instructions and tools) and goes on with the tool call each
CLI was recorded making (tests/fixtures/agents/: Claude Code's `Bash`, Codex's `exec_command`):
every turn adds one call and its output (about `--turn-tokens` of file text, different on every
turn) and asks for the next answer (`--answer-tokens`, greedy). Both systems get the same
requests in one neutral wire format, OpenAI chat completions with tools, so that both render
them with the same template (QWEN_TOOL_TEMPLATE: ours through /api/create, llama-server through
--jinja --chat-template-file). The history sends back the recorded call, not what the random
weights wrote, as a template that re-renders a turn does: each system may reuse the cached
prefix up to the previous request's end and must read the rest.

Both systems load the model before the sessions (ours answers a one-token request first, so
its planning and load are not counted; the row `load_s` says what they took). Per turn: wall
time of the request, prompt tokens, tokens read (the prompt less what came from
the cache: usage.prompt_tokens_details.cached_tokens for ours, timings.prompt_n for
llama-server), answer tokens. Per session: the sum. Systems: `ours` (default settings, the
budget given as the daemon's VRAM margin), `fit-KV` (llama-server on PATH, `--fit on` for the
same budget, KV type f16 or q8_0), `newest-fit-KV` (the newest llama.cpp's llama-server,
lab/device/build_newest_llama.sh, given by --newest-bin), `newest-cache-KV` (the same with
llama.cpp's own expert cache, `--moe-cache-mib`, which --fit is told to leave free). Writes
replay.jsonl and replay.md under --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
from scripts.bench.bench_session import add_budget_args  # noqa: E402
from scripts.bench.bench_systems import Fit, Ours, post  # noqa: E402
from scripts import synth_gguf  # noqa: E402
from scripts.bench.bench_text import text_of  # noqa: E402
from scripts.bench.bench_tuner import MemorySampler  # noqa: E402
from tests.chat_models import QWEN_TOOL_TEMPLATE  # noqa: E402

MIB = 1 << 20
FIRST = ROOT / "localllm" / "cli" / "agent_requests"
FOLLOW = ROOT / "tests" / "fixtures" / "agents"
AGENTS = {  # first request, the recording with the CLI's own tool call
    "claude-code": ("claude-code-2.1.332-default.json", "claude-code-2.1.332-tool-result.json"),
    "codex": ("codex-0.169.0-first.json", "codex-0.169.0-tool-output.json"),
}


# ---- the recorded requests in one neutral form ------------------------------------------
def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if isinstance(b, dict))


def _function(name: str, description: str, parameters: dict | None) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description or "",
        "parameters": parameters or {"type": "object", "properties": {}}}}


def from_anthropic(body: dict) -> tuple[list[dict], list[dict]]:
    """Messages and tools of a recorded /v1/messages body as OpenAI chat completions has them."""
    messages = [{"role": "system", "content": _text(body.get("system") or "")}]
    for m in body["messages"]:
        if isinstance(m["content"], str) or m["role"] == "system":
            messages.append({"role": m["role"], "content": _text(m["content"])})
            continue
        calls = [b for b in m["content"] if b.get("type") == "tool_use"]
        results = [b for b in m["content"] if b.get("type") == "tool_result"]
        if calls:
            messages.append({"role": "assistant", "content": _text(m["content"]),
                             "tool_calls": [_call(c["id"], c["name"], c["input"])
                                            for c in calls]})
        elif results:
            messages += [{"role": "tool", "tool_call_id": r["tool_use_id"],
                          "content": _text(r["content"])} for r in results]
        else:
            messages.append({"role": m["role"], "content": _text(m["content"])})
    tools = [_function(t["name"], t.get("description", ""), t.get("input_schema"))
             for t in body.get("tools", []) if "name" in t]
    return messages, tools


def from_responses(body: dict) -> tuple[list[dict], list[dict]]:
    """Input items and tools of a recorded /v1/responses body as OpenAI chat completions."""
    messages = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    for item in body["input"]:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item["content"])})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                _call(item["call_id"], item["name"], json.loads(item["arguments"]))]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": item["output"]})
    tools = [_function(t["name"], t.get("description", ""), t.get("parameters"))
             for t in body.get("tools", []) if t.get("type") == "function"]
    return messages, tools


def recorded_words(limit: int = 6000) -> tuple[str, ...]:
    """The words of the recorded requests, most frequent first: given to the synthetic
    model's vocabulary whole, so that a recorded prompt reads in about as many tokens as a real
    model's vocabulary makes of it (character by character it would be four times as many)."""
    counts: dict[str, int] = {}
    for first, follow in AGENTS.values():
        for name in (first, follow):
            for word in re.findall(r"[A-Za-z][a-z]{2,}|[A-Z]{2,}", json.dumps(_recorded(name))):
                counts[word] = counts.get(word, 0) + 1
    return tuple(sorted(counts, key=lambda w: -counts[w])[:limit])


def _call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


def _recorded(name: str) -> dict:
    for folder in (FIRST, FOLLOW):
        if (folder / name).exists():
            return json.loads((folder / name).read_text())["body"]
    raise FileNotFoundError(name)


def session(agent: str, turns: int, turn_chars: int) -> list[dict]:
    """The chat completions requests of one session: the recorded first request, then `turns`
    requests that each add the CLI's recorded tool call (on another file) and its output."""
    first_name, follow_name = AGENTS[agent]
    first, follow = _recorded(first_name), _recorded(follow_name)
    convert = from_anthropic if "messages" in first else from_responses
    messages, tools = convert(first)
    recorded_call = next(c for m in convert(follow)[0] for c in m.get("tool_calls", []))
    name = recorded_call["function"]["name"]
    key = next(iter(json.loads(recorded_call["function"]["arguments"])))  # command / cmd
    requests = [list(messages)]
    for turn in range(turns):
        call = _call(f"call_{turn}", name, {key: f"cat src/module_{turn}.py"})
        messages += [{"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"],
                      "content": text_of(turn_chars, seed=1000 + turn)}]
        requests.append(list(messages))
    return [{"messages": m, "tools": tools} for m in requests]


# ---- the systems --------------------------------------------------------------------------
def chat(url: str, body: dict) -> dict:
    """POST a chat completions request; an HTTP error carries the server's own words."""
    try:
        return post(url + "/v1/chat/completions", body)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{e.code}: {e.read().decode(errors='replace')[:500]}") from e


def ask_ours(system: Ours, request: dict, answer_tokens: int) -> dict:
    out = chat(system.url, {
        "model": "replay", **request, "max_tokens": answer_tokens, "temperature": 0,
        "seed": 1, "stream": False})
    usage = out["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"prompt_tokens": usage["prompt_tokens"], "read": usage["prompt_tokens"] - cached,
            "answer_tokens": usage["completion_tokens"]}


def ask_server(system: Fit, request: dict, answer_tokens: int) -> dict:
    out = chat(system.url, {
        **request, "max_tokens": answer_tokens, "temperature": 0, "seed": 1, "stream": False,
        "cache_prompt": True})
    t = out.get("timings", {})
    return {"prompt_tokens": t.get("prompt_n", 0) + t.get("cache_n", 0),
            "read": t.get("prompt_n", 0), "answer_tokens": t.get("predicted_n", 0)}


def start(name: str, model: Path, args, tmp: Path, out: Path):
    budget_mib = int(args.budget * 1024)
    if name == "ours":
        system = Ours(model, args.ctx, budget_mib, args.margin, "auto", tmp)
        urllib.request.urlopen(urllib.request.Request(
            system.url + "/api/create", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "replay", "from": "bench", "template": QWEN_TOOL_TEMPLATE,
                             "stream": False}).encode()), timeout=300).read()
        # Loaded (planned, dry runs and all) before the sessions, as llama-server loads at start
        ask_ours(system, {"messages": [{"role": "user", "content": "hi"}]}, 1)
        return system, ask_ours
    newest = name.startswith("newest-")
    kind, kv = name.removeprefix("newest-").split("-", 1)  # fit-q8_0, cache-q8_0
    template = tmp / "template.jinja"
    template.write_text(QWEN_TOOL_TEMPLATE)
    binary = str(Path(args.newest_bin) / "llama-server") if newest else "llama-server"
    cache = ("--moe-cache-mib", str(args.moe_cache_mib)) if kind == "cache" else ()
    system = Fit(model, args.ctx, budget_mib, kv, args.threads, out / f"{name}-{args.shape}.log",
                 binary=binary, name=name, reserve_mib=args.moe_cache_mib if cache else 0,
                 extra=("--jinja", "--chat-template-file", str(template), *cache))
    return system, ask_server


def replay(name: str, model: Path, args, out: Path, record) -> None:
    with tempfile.TemporaryDirectory() as tmp, MemorySampler() as mem:
        system = None
        try:
            started = time.perf_counter()
            system, ask = start(name, model, args, Path(tmp), out)
            record({"system": name, "load_s": round(time.perf_counter() - started, 1)})
            for agent in args.agents.split(","):
                turns = session(agent, args.turns, args.turn_chars)
                total, rows = time.perf_counter(), []
                for i, request in enumerate(turns):
                    started = time.perf_counter()
                    row = ask(system, request, args.answer_tokens)
                    row = {"system": name, "agent": agent, "turn": i,
                           "seconds": round(time.perf_counter() - started, 2), **row}
                    rows.append(row)
                    record(row)
                record({"system": name, "agent": agent, "turn": "all",
                        "seconds": round(time.perf_counter() - total, 2),
                        "read": sum(r["read"] for r in rows),
                        "later_read": sum(r["read"] for r in rows[1:]),
                        "prompt_tokens": rows[-1]["prompt_tokens"],
                        "answer_tokens": sum(r["answer_tokens"] for r in rows)})
        except Exception as e:  # one system failing must not lose the others' rows
            record({"system": name, "error": f"{type(e).__name__}: {e}"})
        finally:
            if system is not None:
                system.stop()
            logs = Path(tmp) / "xdg_state_home" / "localllm" / "logs"
            if name == "ours" and logs.is_dir():
                shutil.copytree(logs, out / f"ours-logs-{args.shape}", dirs_exist_ok=True)
    record({"system": name, "peak_vram_mib": mem.delta // MIB,
            "budget_mib": int(args.budget * 1024)})


def markdown(rows: list[dict]) -> str:
    lines = ["| system | agent | session s | first turn s | later turns s (each) | tokens read "
             "first / later (each) | prompt at the end | answer tokens |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in (r for r in rows if r.get("turn") == "all"):
        turns = [r for r in rows if r.get("system") == s["system"] and
                 r.get("agent") == s["agent"] and isinstance(r.get("turn"), int)]
        later_s = " ".join(f"{r['seconds']:.1f}" for r in turns[1:])
        later_read = " ".join(str(r["read"]) for r in turns[1:])
        lines.append(
            f"| {s['system']} | {s['agent']} | {s['seconds']:.1f} | {turns[0]['seconds']:.1f} | "
            f"{later_s} | {turns[0]['read']} / {later_read} | {s['prompt_tokens']} | "
            f"{s['answer_tokens']} |")
    lines += [""] + [f"- {r['system']}: started and loaded in {r['load_s']} s (not counted in "
                     "the sessions)" for r in rows if "load_s" in r]
    peaks = [r for r in rows if "peak_vram_mib" in r]
    errors = [r for r in rows if "error" in r]
    lines += [""] + [f"- {r['system']}: peak VRAM {r['peak_vram_mib']} MiB at a budget of "
                     f"{r['budget_mib']} MiB" for r in peaks]
    lines += [f"- {r['system']}: {r['error']}" for r in errors]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_budget_args(p, shape="qwen3-30b-a3b", ctx=65536)
    p.add_argument("--systems", default="ours,newest-fit-q8_0,newest-fit-f16")
    p.add_argument("--newest-bin", default="/tmp/newest/bin",
                   help="the newest llama.cpp's binaries (lab/device/build_newest_llama.sh)")
    p.add_argument("--agents", default=",".join(AGENTS))
    p.add_argument("--turns", type=int, default=8, help="tool calls after the first request")
    p.add_argument("--turn-chars", type=int, default=4000, help="each tool output's length")
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=0, help="llama-server's; 0: its default")
    p.add_argument("--moe-cache-mib", type=int, default=2048,
                   help="newest-cache-KV: llama.cpp's own expert cache, left free by --fit")
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--routing", default="real",
                   help="MoE routers of the synthetic model (docs/synthetic-routing.md)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="a toy model on a CPU, small sizes")
    args = p.parse_args(argv)
    if args.tiny:
        args.ctx, args.budget, args.turns, args.turn_chars, args.answer_tokens = \
            32768, 0.5, 2, 400, 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = synth_gguf.SHAPES[args.shape]
    if args.tiny:  # a vocabulary that holds the recorded words, a context that holds a session
        config = dataclasses.replace(synth_gguf.tiny(config), n_vocab=config.n_vocab,
                                     context_length=args.ctx)
    model = synth_gguf.ensure_model(args.models, config,
                                    routing=args.routing, words=recorded_words(),
                                    vocab_tag="agentwords")
    rows: list[dict] = []
    with open(out / "replay.jsonl", "a") as jsonl:
        def record(row: dict) -> None:
            row = {"shape": args.shape, "ctx": args.ctx, **row}
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(json.dumps(row), flush=True)

        for name in args.systems.split(","):
            replay(name, model, args, out, record)
    (out / "replay.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
