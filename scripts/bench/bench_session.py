#!/usr/bin/env python3
"""A session's moments through the daemon's API beside `llama-server --fit`, on an emulated budget.

    source .device-carry/on-device.sh
    python3 -m scripts.bench.bench_session --shape dense-27b --ctx 32768 --runs short,prompt \
        --out $OUT
    python3 -m scripts.bench.bench_session --tiny --out /tmp/s  # the same code on a CPU, toy model
    python3 -m scripts.bench.bench_session --shape qwen35-27b --ctx 65536 --systems ours,fit-q8_0 \
        --runs agent-rerendered --answer-tokens 128 --out $OUT   # a changed history (#33)

For one synthetic model (scripts/synth_gguf.py, random Q4_0 weights) and one context, each
system in turn: the localllm daemon (12 GiB budget: vram_margin_mib = free - budget + margin,
workload from --workload, default auto: the daemon's default settings; `ours-cache`: the same
with expert_cache = --expert-cache, its hits and misses beside each run; `ours-misses-cpu`,
`ours-misses-gpu`: default settings but expert_misses),
`llama-server --fit on --fit-target (free - budget)` with f16 and with q8_0 KV.
Runs (--runs, in this order):
  short    decode of --tokens after a short prompt
  prompt   a --prompt-tokens prompt (default 16384; 65536 with --ctx 131072): time to first
           token, then decode after it
  deep     the same with a prompt of 90% of --ctx (other text): decode at the context's end,
           beside the plan's prediction there
  agent    a replay: a --system-tokens system prompt, then --turns turns that each add
           --turn-tokens of tool results and answer --answer-tokens; total wall time
  agent-rerendered
           the same replay, but each turn sends other text of the answer's length back in the
           answer's place (what agents send: templates drop earlier turns' thinking, clients
           re-format tool calls), so the cached sequence diverges where the last prompt ended;
           per turn the tokens read against the tokens the turn added
  settle   ours: short answers with --settle-gap idle seconds after each until the plan settles
           (the ways `auto` weighed all measured, no re-plan due; --settle-rounds at most)
  settle-long  ours: the same with a new --prompt-tokens prompt each time (the long fill band)
  session-order
           a real session's order (issue 36): --short-count short requests, then the
           --prompt-tokens prompt (its time to first token, reading speed and decode after it),
           then short requests again; decode after each short prompt before and after
Peak VRAM is NVML's for the whole card, above the baseline before each system starts. Every
measurement is appended to $OUT/session.jsonl as it is made; the table goes to
$OUT/session.md. Runs that would pass --deadline (seconds since the start) are skipped.
The prompts are seeded words of random letters that do not repeat (text_of; a repeated list of
words flattered an expert cache): their token count is calibrated once per system by a
1-token answer (prompt_eval_count / timings.prompt_n), so both sides read the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402, F401  (a CUDA build must load before numpy)

from scripts import synth_gguf  # noqa: E402
from scripts.bench.bench_text import (  # noqa: E402
    SHORT_CHARS, settle_long_prompt, short_prompt, text_of)
from scripts.bench.bench_systems import (  # noqa: E402
    MIB,
    Fit,
    Ours,
    at_depth,
    keep_daemon_logs,
    with_kernel,
)
from scripts.bench.bench_tuner import MemorySampler  # noqa: E402


def calibrate(system, chars_per_token: list[float], ctx: int) -> float:
    if not chars_per_token:
        sample = text_of(min(4000, ctx // 2), 1)
        n = system.generate(sample, 1)["prompt_tokens"] or 1000
        chars_per_token.append(len(sample) / n)
    return chars_per_token[0]


def run_system(system, args, record) -> None:
    cpt: list[float] = []
    warm = system.generate("Hello there. " * 4, 4)  # loads the model (ours) and warms up
    record({"system": system.name, "plan": system.plan(), "warm_ttft": round(warm["ttft"], 2)})
    for run in args.runs:
        if time.monotonic() - args.t0 > args.deadline:
            record({"system": system.name, "run": run, "skipped": "deadline"})
            continue
        if run == "short":
            before = curve_before(system)
            r = system.generate(short_prompt(), args.tokens)
            record({"system": system.name, "run": "short", "decode_tps": round(r["decode_tps"], 2),
                    "answer_tokens": r["answer_tokens"], "band": system.band(),
                    **predicted(system, r["prompt_tokens"], before), **expert_cache(system),
                    **running(system)})
        elif run in ("prompt", "deep"):
            c = calibrate(system, cpt, args.ctx)
            tokens, seed = (args.prompt_tokens, 2) if run == "prompt" else (int(args.ctx * 0.9), 3)
            before = curve_before(system)
            r = system.generate(text_of(int(tokens * c), seed), args.tokens)
            record({"system": system.name, "run": run, "prompt_tokens": r["prompt_tokens"],
                    "ttft": round(r["ttft"], 2),
                    "prompt_tps": round(r["prompt_tokens"] / max(1e-9, r["ttft"]), 1),
                    "decode_tps": round(r["decode_tps"], 2), "answer_tokens": r["answer_tokens"],
                    "band": system.band(), **predicted(system, r["prompt_tokens"], before),
                    **expert_cache(system), **running(system)})
        elif run in ("agent", "agent-rerendered"):
            record(agent_replay(system, args, calibrate(system, cpt, args.ctx),
                                rerendered=run == "agent-rerendered"))
        elif run == "session-order":
            session_order(system, args, record, calibrate(system, cpt, args.ctx))
        elif run == "settle":
            settle(system, args, record)
        elif run == "settle-long":
            settle(system, args, record, calibrate(system, cpt, args.ctx))


def settle(system, args, record, long_chars: float = 0) -> None:
    """Ours: short answers with an idle gap after each (a user reading the answer), as many as
    the plan takes to settle (every way `auto` weighed measured and no re-plan due) or
    --settle-rounds: what each decoded, on which way, and what ps said of the ways.
    `long_chars` (chars per token): answers after a --prompt-tokens prompt instead, a new one
    each time (a user with long documents), which settle the fill band such prompts run in."""
    if not hasattr(system, "settling"):
        return
    run = "settle-long" if long_chars else "settle"
    for round_ in range(args.settle_rounds):
        prompt = settle_long_prompt(int(args.prompt_tokens * long_chars), round_) if long_chars \
            else short_prompt()
        r = system.generate(prompt, args.tokens)
        state = system.settling()
        record({"system": system.name, "run": run, "round": round_,
                "prompt_tokens": r["prompt_tokens"], "decode_tps": round(r["decode_tps"], 2),
                "band": system.band(), **state, **running(system)})
        ways = (state.get("ways") or {}).get("weighed", ())
        if "replan" not in state and all(w["measured_tps"] for w in ways) and round_:
            return
        time.sleep(args.settle_gap)  # idle: the daemon plans again between requests


def expert_cache(system) -> dict:
    """Ours with --expert-cache: the pool's figures so far (hits, misses, hit rate)."""
    figures = system.expert_cache() if hasattr(system, "expert_cache") else None
    return {"expert_cache": figures} if figures else {}


def predicted(system, depth: int, before_run=None) -> dict:
    """Ours: the plan's predicted decode at this depth, beside the measured figure; and, once
    the pool's hits were measured before this run (`before_run`: the curve /api/stats gave
    then, and the band it came from), the plan's decode priced at them: not for a run that
    moved into another band, whose plan and pool are new."""
    guess = system.predicted(depth) if hasattr(system, "predicted") else None
    out = {"predicted_decode_tps": guess} if guess is not None else {}
    curve, band = before_run or (None, None)
    now = system.band() if hasattr(system, "band") else None
    same_plan = (band or {}).get("n_ctx") == (now or {}).get("n_ctx")
    at_hits = at_depth(curve, depth) if same_plan else None
    if at_hits is not None:
        out["predicted_at_measured_hits_tps"] = at_hits
    return out


def curve_before(system):
    """The curve at the pool's measured hits before a run, with the band it was priced in:
    a run that moves the runner into another band runs another plan and pool."""
    if not hasattr(system, "curve_at_hits"):
        return None
    return system.curve_at_hits(), system.band()


def running(system) -> dict:
    """Ours: the plan the run ran on (/api/stats)."""
    return {"running": system.running()} if hasattr(system, "running") else {}


def agent_replay(system, args, chars_per_token: float, rerendered: bool) -> dict:
    """The agent session: each turn adds a tool result to the raw transcript and takes an
    answer; the answer goes back as the model wrote it, or (`rerendered`) as other text of its
    length. Per turn: time to first token, the whole prompt, the tokens read and the tokens the
    turn added (the answer in the form sent back, then the tool result)."""
    c = chars_per_token
    # a system prompt of its own per run: the second run starts as cold as the first
    conversation = text_of(int(args.system_tokens * c), 4 if rerendered else 3)
    start = time.perf_counter()
    turns, before = [], 0
    for turn in range(args.turns):
        conversation += "\nTool result:\n" + text_of(int(args.turn_tokens * c), 10 + turn)
        r = system.generate(conversation, args.answer_tokens)
        row = {"ttft": round(r["ttft"], 2), "decode_tps": round(r["decode_tps"], 2),
               "prompt_tokens": r["prompt_total"], "read": r["read"],
               "new": r["prompt_total"] - before if turn else r["prompt_total"]}
        if r.get("cached_from") is not None:
            row.update(cached_from=r["cached_from"], checkpoint=r["checkpoint"])
        if getattr(args, "vram_peak", None):  # where a run went past its budget, which turn
            row["vram_peak_mib"] = args.vram_peak()
        turns.append(row)
        before = r["prompt_total"]
        # Other words where the answer was: the cached sequence holds the model's own tokens
        # and the next prompt diverges right where this one ended.
        conversation += " " + text_of(max(16, len(r["text"])), 100 + turn) if rerendered \
            else r["text"]
    later = turns[1:]
    return {"system": system.name, "run": "agent-rerendered" if rerendered else "agent",
            "wall_s": round(time.perf_counter() - start, 1), "turns": turns,
            # turns 2+: tokens read per token added (1.0: only what the turn added)
            "read_per_new": round(sum(t["read"] for t in later)
                                  / max(1, sum(t["new"] for t in later)), 2) if later else None,
            "band": system.band()}


def ours_settings(system: str, args) -> dict[str, str]:
    """The daemon's settings for one of our systems: `ours` the defaults, `ours-cache` with
    expert_cache = --expert-cache, `ours-misses-cpu` / `-gpu` with expert_misses (issue 40);
    over those exported to the command (bench_systems.daemon_settings)."""
    if system == "ours":
        return {}
    if system == "ours-cache":
        return {"LOCALLLM_EXPERT_CACHE": str(args.expert_cache)}
    if system in ("ours-misses-cpu", "ours-misses-gpu"):
        return {"LOCALLLM_EXPERT_MISSES": system.removeprefix("ours-misses-")}
    raise SystemExit(f"unknown system {system!r}")


def session_order(system, args, record, chars_per_token: float) -> None:
    """Short requests, the long prompt, short requests again, each a request of its own (as an
    editor's side requests and a pasted file arrive): the long prompt's time to first token is
    what a band planned for short prompts cost (issue 36)."""
    def short(i: int) -> float:
        prompt = f"Request {i}: " + text_of(SHORT_CHARS, 1000 + i)
        return system.generate(prompt, args.tokens)["decode_tps"]

    before = [short(i) for i in range(args.short_count)]
    band_before = system.band()
    r = system.generate(text_of(int(args.prompt_tokens * chars_per_token), 4), args.tokens)
    band_long = system.band()
    after = [short(100 + i) for i in range(max(1, args.short_count // 3))]
    record({"system": system.name, "run": "session-order", "prompt_tokens": r["prompt_tokens"],
            "ttft": round(r["ttft"], 2),
            "prompt_tps": round(r["prompt_tokens"] / max(1e-9, r["ttft"]), 1),
            "decode_after_prompt_tps": round(r["decode_tps"], 2),
            "short_before_tps": round(sorted(before)[len(before) // 2], 2),
            "short_after_tps": round(sorted(after)[len(after) // 2], 2),
            "band_before": band_before, "band_after_prompt": band_long,
            "plan": system.plan()})


def add_budget_args(p: argparse.ArgumentParser, shape: str, ctx: int) -> None:
    """The model, context and emulated card every budget benchmark takes."""
    p.add_argument("--shape", default=shape, choices=tuple(synth_gguf.SHAPES))
    p.add_argument("--ctx", type=int, default=ctx)
    p.add_argument("--budget", type=float, default=12, metavar="GiB")
    p.add_argument("--margin", type=int, default=128, metavar="MiB",
                   help="VRAM the tuner leaves free inside the budget")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_budget_args(p, shape="dense-27b", ctx=32768)
    p.add_argument("--workload", default="auto", choices=("auto", "chat", "agent"),
                   help="ours: the workload setting (auto: the default, learned as it serves)")
    p.add_argument("--systems", default="ours,fit-f16,fit-q8_0")
    p.add_argument("--fill-bands", default="auto", help="ours: the fill_bands setting")
    p.add_argument("--expert-cache", default="512",
                   help="system ours-cache: the expert_cache setting (slots, or auto)")
    p.add_argument("--runs", default="short,prompt")
    p.add_argument("--tokens", type=int, default=48, help="decoded per decode measurement")
    p.add_argument("--learned", default="", metavar="DIR",
                   help="ours: keep what the daemon learns here (ways, hits, prices) from one "
                        "run of this script to the next, as a user's config folder does")
    p.add_argument("--settle-rounds", type=int, default=12, help="settle: answers at most")
    p.add_argument("--settle-gap", type=float, default=6.0,
                   help="settle: idle seconds after each answer (the daemon re-plans after 5)")
    p.add_argument("--short-count", type=int, default=10,
                   help="session-order: short requests before the long prompt")
    p.add_argument("--prompt-tokens", type=int, default=0, help="0: 16384, 65536 at >= 128K")
    p.add_argument("--system-tokens", type=int, default=20000)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-tokens", type=int, default=2048)
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--llama-server", default="llama-server",
                   help="the fit systems' binary (default: the one on PATH, the vendored build)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 16)
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--routing", default="uniform",
                   help="MoE routers of the synthetic model: uniform, balanced, zipf:S, "
                        "local:G,S or real (docs/synthetic-routing.md)")
    p.add_argument("--deadline", type=float, default=520, help="seconds; later runs skipped")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="a toy model on a CPU, small sizes")
    p.add_argument("--experts", type=int, default=0,
                   help="MoE shapes: write N experts a block, not the real count (with a budget "
                        "that holds every weight: bench_resident.py's files, through the daemon)")
    args = p.parse_args(argv)
    args.t0 = time.monotonic()
    args.runs = args.runs.split(",")
    if args.tiny:
        args.ctx, args.budget, args.tokens, args.short_count = 2048, 0.5, 8, 3
        args.system_tokens, args.turn_tokens, args.answer_tokens, args.turns = 300, 100, 8, 3
        args.prompt_tokens = args.prompt_tokens or 600
    if not args.prompt_tokens:
        args.prompt_tokens = 65536 if args.ctx >= 131072 else 16384
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = synth_gguf.tiny(synth_gguf.SHAPES[args.shape]) if args.tiny \
        else synth_gguf.fewer_experts(synth_gguf.SHAPES[args.shape], args.experts)
    model = synth_gguf.ensure_model(args.models, config, routing=args.routing)
    rows: list[dict] = []
    with open(out / "session.jsonl", "a") as jsonl:
        def record(row: dict) -> None:
            row = {"shape": args.shape, "ctx": args.ctx, "t": round(time.monotonic() - args.t0),
                   **({"routing": args.routing} if args.routing != "uniform" else {}),
                   **({"experts": config.n_expert} if args.experts else {}), **row}
            row = with_kernel(row)
            rows.append(row)
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(json.dumps(row), flush=True)

        budget_mib = int(args.budget * 1024)
        for name in args.systems.split(","):
            if time.monotonic() - args.t0 > args.deadline:
                record({"system": name, "skipped": "deadline"})
                continue
            with tempfile.TemporaryDirectory() as tmp, MemorySampler() as mem:
                system = None
                try:
                    if name == "ours" or name.startswith("ours-"):
                        learned = Path(args.learned) if args.learned else None
                        system = Ours(model, args.ctx, budget_mib, args.margin, args.workload,
                                      Path(tmp), args.fill_bands, learned,
                                      **ours_settings(name, args))
                        system.name = name
                    elif name.startswith("fit-"):
                        if args.tiny:
                            record({"system": name, "skipped": "--tiny"})
                            continue
                        system = Fit(model, args.ctx, budget_mib, name[4:], args.threads,
                                     out / f"{name}-{args.shape}-{args.ctx}.log",
                                     binary=args.llama_server)
                    else:
                        raise SystemExit(f"unknown system {name!r}")
                    args.vram_peak = lambda mem=mem: (mem.peak - mem.baseline) // MIB
                    run_system(system, args, record)
                except Exception as e:  # one system failing must not lose the others' rows
                    record({"system": name, "error": f"{type(e).__name__}: {e}"})
                finally:
                    if system is not None:
                        system.stop()
                    if name.startswith("ours"):  # the daemon's and runner's logs
                        keep_daemon_logs(Path(tmp), out / f"{name}-logs-{args.shape}-{args.ctx}")
            record({"system": name, "peak_vram_mib": mem.delta // MIB, "budget_mib": budget_mib})
    (out / "session.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    return 0


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | ctx | system | run | figures |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        figures = {k: v for k, v in r.items() if k not in ("shape", "ctx", "system", "run", "t")}
        lines.append(f"| {r['shape']} | {r['ctx']} | {r.get('system', '')} | {r.get('run', '')} "
                     f"| {json.dumps(figures)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
