#!/usr/bin/env python3
"""localllm against the strongest llama.cpp of the same lease: swept settings, alternating runs.

    source .device-carry/on-device.sh && eval "$(bash tests/gpu/device_engine.sh)"
    newest=$(bash lab/device/build_newest_llama.sh)     # llama.cpp's newest server
    python3 -m scripts.bench.bench_baseline --phase sweep --shape qwen3-30b-a3b \
        --routing zipf:0.3 --newest $newest --out $OUT        # best threads, expert-cache size
    python3 -m scripts.bench.bench_baseline --phase rounds --rounds 3 --best $OUT/best.json \
        --shape qwen3-30b-a3b --routing zipf:0.3 --newest $newest --out $OUT
    python3 -m scripts.bench.bench_baseline --summarize baseline.jsonl [more.jsonl ...]

Systems (--systems):
  ours              the localllm daemon with default settings
  ours-all-cores    the same with num_thread = all cores (what decode took before the thread
                    count came from the machine's measured read rate)
  vendored-fit      `llama-server --fit` of the llama.cpp inside llama-cpp-python 0.3.36 (on
                    PATH after on-device.sh), q8_0 KV
  newest-fit        the same with the newest llama.cpp (--newest: the folder of its build,
                    lab/device/build_newest_llama.sh)
  newest-fit-cache  newest-fit with llama.cpp's own expert cache (`--moe-cache-mib`, left free
                    by --fit, which does not count it)
Every system gets the same budget: --budget GiB of the card (ours: vram_margin_mib = free -
budget; llama-server: --fit-target free - budget).

`--phase sweep` first lets ours settle (short answers with idle gaps until the ways `auto` weighs
are measured; --settle-long: then answers after long prompts, which run in a fill band of their
own with ways of their own; what it learns, OUT/ours-learned, every later start of ours begins
with, as a user's machine does after its first answers), then measures each llama.cpp system's
decode after a short prompt at each thread count of --thread-sweep (0: llama.cpp's default), then
newest-fit-cache at its best threads with each size of --cache-sweep (decode after a short prompt
and after the long prompt), and writes the best settings to OUT/best.json.
`--phase rounds` runs every system --rounds times, alternating (round r starts at system r, so
no system always runs first or last after the same neighbour), each at its best settings: a
decode after a short prompt, then a --prompt-tokens prompt (time to first token, reading
speed) and the decode after it. Every
measurement is appended to OUT/baseline.jsonl as it is made; `--summarize` gives, per run and
system, the median with min and max, and ours over the best baseline of the same file.
A lease is 10 minutes a call: give --deadline and run the rounds over several calls
(--round-offset), their rows appended to one file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MIB = 1 << 20
SYSTEMS = ("ours", "vendored-fit", "newest-fit", "newest-fit-cache", "ours-all-cores")
# the figures a round measures, and whether more is better
FIGURES = {"short_decode_tps": True, "prompt_tps": True, "ttft_s": False,
           "decode_after_prompt_tps": True}


def start(name: str, args, model: Path, tmp: Path, threads: int, cache_mib: int):
    """One system, loaded and ready."""
    from scripts.bench.bench_systems import Fit, Ours

    budget_mib = int(args.budget * 1024)
    if name in ("ours", "ours-all-cores"):
        options = {"num_thread": os.cpu_count() or 1} if name == "ours-all-cores" else {}
        system = Ours(model, args.ctx, budget_mib, args.margin, "auto", tmp, "auto",
                      learned=Path(args.out) / "ours-learned", options=options)
        system.name = name
        return system
    if name == "vendored-fit":
        binary = "llama-server"
    elif name.startswith("newest-"):
        if not args.newest:
            raise SystemExit(f"{name} needs --newest (the newest llama.cpp's build folder)")
        binary = str(Path(args.newest) / "llama-server")
    else:
        raise SystemExit(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    extra = ("--moe-cache-mib", str(cache_mib)) if name == "newest-fit-cache" else ()
    return Fit(model, args.ctx, budget_mib, "q8_0", threads, tmp / f"{name}.log", binary=binary,
               extra=extra, reserve_mib=cache_mib if extra else 0, name=name)


def measure(system, args, with_prompt: bool) -> dict:
    """Decode after a short prompt; with_prompt: then the long prompt and the decode after."""
    from scripts.bench.bench_session import calibrate, text_of

    system.generate("Hello there. " * 4, 4)  # loads (ours) and warms up
    short = system.generate(text_of(300, 11), args.tokens)
    row = {"short_decode_tps": round(short["decode_tps"], 2),
           **beside(system, "short", short["prompt_tokens"])}
    if with_prompt:
        chars = calibrate(system, [], args.ctx)
        r = system.generate(text_of(int(args.prompt_tokens * chars), 12), args.tokens)
        row.update(prompt_tokens=r["prompt_tokens"], ttft_s=round(r["ttft"], 2),
                   prompt_tps=round(r["prompt_tokens"] / max(1e-9, r["ttft"]), 1),
                   decode_after_prompt_tps=round(r["decode_tps"], 2),
                   **beside(system, "after_prompt", r["prompt_tokens"]))
    return row


def beside(system, moment: str, depth: int) -> dict:
    """Ours: the running plan's predicted decode at this depth and the way it ran (the planner's
    figure beside each measured one); {} for llama.cpp."""
    if not hasattr(system, "predicted"):
        return {}
    way = (system.settling().get("ways") or {}).get("running")
    return {f"predicted_{moment}_tps": system.predicted(depth), f"way_{moment}": way}


def one(name: str, args, model: Path, record, *, threads: int = 0, cache_mib: int = 0,
        with_prompt: bool = True, **tags) -> dict | None:
    """Start a system, measure, stop; the row recorded (an error is a row too)."""
    from scripts.bench.bench_tuner import MemorySampler

    if time.monotonic() - args.t0 > args.deadline:
        record({"system": name, **tags, "skipped": "deadline"})
        return None
    settings = {"threads": threads, **({"moe_cache_mib": cache_mib} if cache_mib else {})}
    with tempfile.TemporaryDirectory() as tmp, MemorySampler() as mem:
        system = None
        try:
            system = start(name, args, model, Path(tmp), threads, cache_mib)
            row = measure(system, args, with_prompt)
        except Exception as e:  # one system failing must not lose the others' rows
            row = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if system is not None:
                system.stop()
            if name.startswith("ours"):  # what its daemon decided (ways, bands), kept
                from scripts.bench.bench_systems import keep_daemon_logs

                keep_daemon_logs(Path(tmp), Path(args.out) / "logs" / "-".join(
                    [name, *(str(v) for v in tags.values())]))
    row = {"system": name, **tags, **(settings if not name.startswith("ours") else {}), **row,
           "peak_vram_mib": mem.delta // MIB, "budget_mib": int(args.budget * 1024)}
    record(row)
    return row


def sweep(args, model: Path, record) -> dict:
    """Ours settled (the ways `auto` weighs measured: bench_session.settle), then each
    llama.cpp system's best thread count, then the expert cache's best size."""
    best: dict[str, dict] = {}
    if "ours" in args.systems:
        settle_ours(args, model, record)
    for name in (s for s in args.systems if not s.startswith("ours")):
        rows = [one(name, args, model, record, threads=t, with_prompt=False, phase="sweep")
                for t in args.thread_sweep]
        done = [r for r in rows if r and "short_decode_tps" in r and within(r)]
        if done:
            top = max(done, key=lambda r: r["short_decode_tps"])
            best[name] = {"threads": top["threads"]}
    if "newest-fit-cache" in args.systems:
        threads = best.get("newest-fit-cache", best.get("newest-fit", {})).get("threads", 0)
        rows = [one("newest-fit-cache", args, model, record, threads=threads, cache_mib=m,
                    phase="cache-sweep") for m in args.cache_sweep]
        done = [r for r in rows if r and "decode_after_prompt_tps" in r and within(r)]
        if done:  # the size that decodes best over both depths
            top = max(done, key=lambda r: r["short_decode_tps"] + r["decode_after_prompt_tps"])
            best["newest-fit-cache"] = {"threads": threads, "moe_cache_mib": top["moe_cache_mib"]}
    return best


def settle_ours(args, model: Path, record) -> None:
    """Ours with default settings, short answers with idle gaps until its plan settles; what
    it learned (OUT/ours-learned) every later start of ours begins with, as on a user's machine
    after its first answers."""
    from scripts.bench.bench_session import calibrate, settle

    with tempfile.TemporaryDirectory() as tmp:
        system = None
        try:
            system = start("ours", args, model, Path(tmp), 0, 0)
            system.generate("Hello there. " * 4, 4)
            settle(system, args, lambda row: record({"phase": "settle", **row}))
            if args.settle_long:  # the band a long prompt runs in has ways of its own
                settle(system, args, lambda row: record({"phase": "settle", **row}),
                       calibrate(system, [], args.ctx))
        except Exception as e:
            record({"system": "ours", "phase": "settle", "error": f"{type(e).__name__}: {e}"})
        finally:
            if system is not None:
                system.stop()


def within(row: dict) -> bool:
    """A setting that went past the budget is no candidate: it bought its speed with memory."""
    return row.get("peak_vram_mib", 0) <= row.get("budget_mib", 1 << 40)


def rounds(args, model: Path, record, best: dict) -> None:
    systems = list(args.systems)
    for r in range(args.round_offset, args.round_offset + args.rounds):
        k = r % len(systems)
        for name in systems[k:] + systems[:k]:
            settings = best.get(name, {})
            one(name, args, model, record, threads=settings.get("threads", 0),
                cache_mib=settings.get("moe_cache_mib", args.cache_sweep[-1]), phase="round",
                round=r)


def summarize(rows: list[dict]) -> str:
    """Per figure and system: median [min-max] (runs); ours over the best baseline's median."""
    runs = [r for r in rows if r.get("phase") == "round" and "error" not in r]
    systems = sorted({r["system"] for r in runs}, key=lambda s: (s != "ours", s))
    lines = ["| figure | " + " | ".join(systems) + " | ours / best baseline |",
             "| --- |" + " --- |" * (len(systems) + 1)]
    for figure, higher in FIGURES.items():
        medians, cells = {}, []
        for s in systems:
            values = [r[figure] for r in runs if r["system"] == s and figure in r]
            if not values:
                cells.append("-")
                continue
            medians[s] = statistics.median(values)
            cells.append(f"{medians[s]:g} [{min(values):g}-{max(values):g}] ({len(values)})")
        baselines = {s: m for s, m in medians.items() if not s.startswith("ours")}
        ratio = "-"
        if "ours" in medians and baselines:
            strongest = (max if higher else min)(baselines, key=baselines.get)
            value = medians["ours"] / baselines[strongest] if higher else \
                baselines[strongest] / max(1e-9, medians["ours"])
            ratio = f"{value:.2f}x ({strongest})"
        lines.append(f"| {figure} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--summarize", nargs="+", metavar="JSONL", help="only print the table")
    p.add_argument("--phase", choices=("sweep", "rounds"), default="rounds")
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--routing", default="uniform", help="synth_gguf's --routing")
    p.add_argument("--ctx", type=int, default=32768)
    p.add_argument("--budget", type=float, default=12, metavar="GiB")
    p.add_argument("--margin", type=int, default=128, metavar="MiB")
    p.add_argument("--systems", default=",".join(SYSTEMS[:4]))
    p.add_argument("--newest", default="", help="folder with the newest llama.cpp's llama-server")
    p.add_argument("--thread-sweep", default="0,8,12,16", help="0: llama.cpp's default")
    p.add_argument("--cache-sweep", default="2048,4096,6144", metavar="MiB,...")
    p.add_argument("--best", default="", help="best.json of a sweep (default: OUT/best.json)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-offset", type=int, default=0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--settle-rounds", type=int, default=12, help="ours' settling: answers at most")
    p.add_argument("--settle-gap", type=float, default=6.0, help="ours' settling: idle seconds")
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--settle-long", action="store_true",
                   help="ours' settling: then answers after --prompt-tokens prompts")
    p.add_argument("--models", default="/tmp/models")
    p.add_argument("--deadline", type=float, default=540, help="seconds; later runs skipped")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true", help="a toy model on a CPU: the code, no figures")
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(read_rows(args.summarize)))
        return 0

    import llama_cpp  # noqa: F401  (a CUDA build must load before numpy)

    from scripts import synth_gguf

    args.t0 = time.monotonic()
    args.systems = [s for s in args.systems.split(",") if s]
    args.thread_sweep = [int(t) for t in args.thread_sweep.split(",")]
    args.cache_sweep = [int(m) for m in args.cache_sweep.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = synth_gguf.SHAPES[args.shape]
    if args.tiny:
        config = synth_gguf.tiny(config)
        args.ctx, args.budget, args.tokens, args.prompt_tokens = 2048, 0.5, 8, 600
    model = synth_gguf.ensure_model(args.models, config, routing=args.routing)
    # the newest build's name, where a system of it runs (a lease without the build passes
    # --newest all the same: its queue names one folder for either baseline)
    newest = any(s.startswith("newest-") for s in args.systems)
    source = (Path(args.newest) / "SOURCE").read_text().strip() if args.newest and newest else ""
    from scripts.bench.bench_systems import with_kernel

    with open(out / "baseline.jsonl", "a") as jsonl:
        def record(row: dict) -> None:
            row = with_kernel({"shape": args.shape, "routing": args.routing, "ctx": args.ctx,
                               **({"newest": source} if source else {}),
                               "t": round(time.monotonic() - args.t0), **row})
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(json.dumps(row), flush=True)

        if args.phase == "sweep":
            best = sweep(args, model, record)
            (out / "best.json").write_text(json.dumps(best, indent=1) + "\n")
            print(json.dumps(best))
        else:
            best_file = Path(args.best) if args.best else out / "best.json"
            best = json.loads(best_file.read_text()) if best_file.is_file() else {}
            rounds(args, model, record, best)
    print(summarize(read_rows([str(out / "baseline.jsonl")])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
