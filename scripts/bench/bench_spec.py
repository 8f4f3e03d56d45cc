#!/usr/bin/env python3
"""Speculative decoding on one machine: what a checking pass costs, and what drafting gives.

    python -m scripts.bench.bench_spec --model M.gguf [--ngl 99 --ngl 44] [--draft-other D.gguf]

1. Checking cost: llama_decode of B = 1, 2, 4, 8 tokens at a depth of 256, through the runner's
   own loader (localllm/engine/model.py) with each placement, beside llama-bench ppB at the same
   depth (when llama-bench is on PATH); as tokens/s and as the cost of a pass over a pass of 1.
2. Decode through the daemon's API (/api/generate, eval_count / eval_duration, median of
   --rounds), per placement: plain; prompt lookup on the model's own greedy text; the model as
   its own draft (full acceptance: the upper bound of a draft model, drafting at the target's
   price); a draft model whose drafts never match (--draft-other: adaptive drafting must stay
   near plain speed); MTP, when the model has NextN layers; prompt lookup at temperature 1
   (drafts seldom match).
3. The tuner's plans for this GPU cut to each --budget: predicted decode (plain, and with the
   speculation it chose at its assumed acceptance) beside what the engine measures loaded with
   that plan (plain, and drafting as the plan says, with the acceptance it saw).

Prints markdown tables; writes them to $OUT/bench_spec.md when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402  (a CUDA build must load before numpy)

BATCHES = (1, 2, 4, 8)
DEPTH = 256


# ---- 1. checking cost ----------------------------------------------------------------------
def engine_check_cost(model: Path, ngl: int, threads: int, reps: int = 10) -> dict[int, float]:
    """tokens/s of a llama_decode of B tokens after DEPTH tokens, through the runner's loader."""
    from localllm.engine import model as llama
    from localllm.planner.plan import cpu_plan

    plan = replace(cpu_plan(2048), n_gpu_layers=ngl, n_threads=threads, n_threads_batch=threads)
    lm = llama.load(str(model), plan)
    batch = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int) -> None:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        batch.n_tokens = len(tokens)
        if llama_cpp.llama_decode(lm.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        llama_cpp.llama_synchronize(lm.ctx)

    decode([100 + i % 50 for i in range(DEPTH)], 0)
    out = {}
    for b in BATCHES:
        times = []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            decode([200 + (r + i) % 50 for i in range(b)], DEPTH)
            times.append(time.perf_counter() - t0)
            llama_cpp.llama_memory_seq_rm(lm.memory, 0, DEPTH, -1)
        out[b] = b / statistics.median(times[1:])
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(lm.ctx)
    llama_cpp.llama_model_free(lm.model)
    return out


def bench_check_cost(model: Path, ngl: int, threads: int) -> dict[int, float] | None:
    if not shutil.which("llama-bench"):
        return None
    base = ["llama-bench", "-m", str(model), "-n", "0", "-r", "5", "-o", "json", "-ngl",
            str(ngl), "-t", str(threads), "-fa", "1", "-p", ",".join(map(str, BATCHES)),
            "-ub", "512"]
    for extra in (["-d", str(DEPTH)], []):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=900)
        if out.returncode == 0:
            return {r["n_prompt"]: r["avg_ts"] for r in json.loads(out.stdout)}
    print(out.stderr[-1500:], file=sys.stderr)
    return None


# ---- 2. decode through the API -------------------------------------------------------------
def generate(url: str, options: dict, prompt: str = "Once upon a time") -> dict:
    body = json.dumps({"model": "bench", "prompt": prompt, "raw": True, "stream": False,
                       "options": options}).encode()
    req = urllib.request.Request(url + "/api/generate", data=body)
    with urllib.request.urlopen(req, timeout=1800) as resp:
        return json.loads(resp.read())


def rate(url: str, options: dict, rounds: int) -> tuple[float, dict]:
    rates, last = [], {}
    for _ in range(rounds):
        r = generate(url, options)
        rates.append(r["eval_count"] / (r["eval_duration"] / 1e9))
        last = r.get("stats", {}).get("draft", {})
    return statistics.median(rates), last


def api_modes(args, ngl: int) -> list[tuple[str, float, dict]]:
    from tests.daemon_process import isolated_env, start_daemon
    from localllm.modelstore.shape import read_shape
    from localllm.modelstore.store import ModelStore

    n = args.tokens
    greedy = {"temperature": 0, "num_predict": n, "num_gpu": ngl, "seed": 1}
    modes = [("plain", {**greedy, "speculative": "off"}),
             ("prompt lookup", {**greedy, "speculative": "lookup"}),
             ("itself as draft model", {**greedy, "speculative": "draft",
                                        "draft_model": "bench"})]
    if args.draft_other:
        modes.append(("a draft that never matches", {**greedy, "speculative": "draft",
                                                     "draft_model": "other"}))
    if read_shape(args.model).n_nextn:  # random NextN weights: drafts that seldom match
        modes.append(("MTP", {**greedy, "speculative": "mtp"}))
    sampled = {**greedy, "temperature": 1.0, "top_k": 40, "top_p": 1.0}
    modes += [("plain, temperature 1", {**sampled, "speculative": "off"}),
              ("prompt lookup, temperature 1", {**sampled, "speculative": "lookup"})]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = isolated_env(Path(tmp), LOCALLLM_NUM_PARALLEL="1",
                           LOCALLLM_CONTEXT_POLICY="fixed", LOCALLLM_CONTEXT_LENGTH="4096")
        store = ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")
        store.import_gguf(args.model, "bench")
        if args.draft_other:
            store.import_gguf(args.draft_other, "other")
        daemon = start_daemon(env)
        try:
            for label, options in modes:
                generate(daemon.url, {**options, "num_predict": 8})  # load, warm up
                tps, draft = rate(daemon.url, options, args.rounds)
                rows.append((label, tps, draft))
                print(f"  ngl {ngl}: {label}: {tps:.1f} tok/s {draft}", flush=True)
        finally:
            daemon.stop()
    return rows


# ---- 3. the tuner's plan -------------------------------------------------------------------
def engine_decode(model: Path, plan, mode: str, tokens: int, rounds: int) -> tuple[float, dict]:
    """Greedy decode tok/s through the runner's engine loaded with `plan` (median of rounds)."""
    import threading

    from localllm.engine.runner.engine import RunnerEngine
    from localllm.engine.runner.protocol import (
        Done,
        Failure,
        GenerationRequest,
        SamplingOptions,
    )

    engine = RunnerEngine(str(model), plan)
    loop = threading.Thread(target=engine.run, daemon=True)
    loop.start()
    rates, draft = [], {}
    for r in range(rounds + 1):  # the first is a warm-up
        finished, events = threading.Event(), []

        def emit(event, events=events, finished=finished):
            events.append(event)
            if isinstance(event, (Done, Failure)):
                finished.set()

        options = SamplingOptions(temperature=0, num_predict=tokens, speculative=mode)
        engine.submit(GenerationRequest(id=str(r), prompt="Once upon a time", options=options),
                      emit, threading.Event())
        finished.wait(1800)
        done = events[-1]
        if isinstance(done, Failure):
            raise RuntimeError(done.message)
        if r:
            rates.append(done.eval_count / (done.eval_duration_ns / 1e9))
            if done.drafted is not None:
                draft = {"drafted": done.drafted, "accepted": done.draft_accepted}
    engine.close()
    loop.join(120)
    llama_cpp.llama_free(engine.lm.ctx)
    llama_cpp.llama_model_free(engine.lm.model)
    return statistics.median(rates), draft


def tuner_rows(args) -> list[str]:
    from scripts.bench.bench_tuner import gpu_card
    from localllm.modelstore.shape import read_shape
    from localllm.planner.search import NoPlanFits, Request
    from localllm.profiles.choose import tune_checked

    shape = read_shape(args.model)
    out = []
    for budget in args.budget:
        card = gpu_card(budget)
        try:
            plan = tune_checked(shape, card, Request(n_ctx=args.ctx, num_parallel=1))
        except NoPlanFits as e:
            out.append(f"| {budget:g} GiB | no plan: {e} | | | | | |")
            continue
        plain, _ = engine_decode(args.model, plan, "off", args.tokens, args.rounds)
        spec, draft = ((plain, {}) if plan.speculative == "off" else
                       engine_decode(args.model, plan, "auto", args.tokens, args.rounds))
        n_all = shape.n_layer + 1
        in_ram = [o.pattern for o in plan.tensor_overrides if "ffn" in o.pattern]
        blocks = in_ram[0].split("(")[1].split(")")[0].count("|") + 1 if in_ram else 0
        ffn = f", FFN of {blocks} blocks in RAM" if in_ram else ""
        out.append(f"| {budget:g} GiB, ctx {plan.n_ctx}: {min(plan.n_gpu_layers, n_all)}/"
                   f"{n_all} layers on GPU{ffn}, {plan.type_k} KV | {plan.speculative}"
                   f"{f', drafts up to {plan.draft_n_max}' if plan.draft_n_max else ''} | "
                   f"{plan.predicted_plain_decode_tps or plan.predicted_decode_tps:.1f} | "
                   f"{plain:.1f} | {plan.predicted_decode_tps:.1f} | {spec:.1f} | "
                   f"{draft.get('accepted', '-')}/{draft.get('drafted', '-')} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--ngl", type=int, action="append",
                        help="GPU layers per placement (repeat); default all")
    parser.add_argument("--draft-other", type=Path,
                        help="a draft model with the same vocabulary whose drafts never match")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 4)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, action="append",
                        help="VRAM budgets (GiB) the tuner plans for (repeat); default 141, 24")
    parser.add_argument("--ctx", type=int, default=8192, help="context the tuner plans")
    parser.add_argument("--skip", default="", help="parts to skip: check,api,tuner")
    args = parser.parse_args()
    placements = args.ngl or [999]
    lines = [f"# Speculative decoding, {args.model.name}", ""]
    if "check" not in args.skip:
        lines += ["## Checking B tokens in one pass (tokens/s; cost of the pass / pass of 1)",
                  "", "| placement | source | " + " | ".join(f"B={b}" for b in BATCHES) + " |",
                  "| --- | --- |" + " --- |" * len(BATCHES)]
        for ngl in placements:
            for source, figures in (("localllm engine", engine_check_cost(args.model, ngl,
                                                                          args.threads)),
                                    ("llama-bench ppB", bench_check_cost(args.model, ngl,
                                                                         args.threads))):
                if not figures:
                    continue
                cells = [f"{figures[b]:.1f} ({b * figures[1] / figures[b]:.2f}x)"
                         for b in BATCHES]
                lines.append(f"| ngl {ngl} | {source} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    if "api" not in args.skip:
        lines += ["", f"## Decode through the API ({args.tokens} tokens, median of "
                  f"{args.rounds})", "", "| placement | mode | tok/s | vs plain | drafted | "
                  "accepted |", "| --- | --- | --- | --- | --- | --- |"]
        for ngl in placements:
            rows = api_modes(args, ngl)
            plain = {label: tps for label, tps, _ in rows}
            for label, tps, draft in rows:
                base = plain["plain, temperature 1" if "temperature 1" in label else "plain"]
                lines.append(f"| ngl {ngl} | {label} | {tps:.1f} | {tps / base:.2f}x | "
                             f"{draft.get('drafted', '')} | {draft.get('accepted', '')} |")
    if "tuner" not in args.skip:
        args.budget = args.budget or [141, 24]
        lines += ["", "## The tuner's plans: predicted vs measured decode (tok/s, short "
                  "prompt, the engine loaded with the plan)", "",
                  "| budget and plan | speculation | predicted plain | measured plain | "
                  "predicted, plan's choice | measured, plan's choice | accepted/drafted |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += tuner_rows(args)
    text = "\n".join(lines)
    print("\n" + text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_spec.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
