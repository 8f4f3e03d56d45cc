#!/usr/bin/env python3
"""The past-RAM tier for real: a model larger than VRAM plus RAM, in a cgroup that limits RAM.

    source .device-carry/on-device.sh
    python3 -m scripts.bench.bench_past_ram --out $OUT                # 70B-class Q4_0 (37 GiB),
                                                                # 12 GiB VRAM, memory.max 24 GiB
    python3 -m scripts.bench.bench_past_ram --tiny --systems ours --out /tmp/p   # the same code on
                                                                # a CPU: a 1B model, 1 GiB

The model is written first (scripts/synth_gguf.py), then this process moves itself into a
memory cgroup (v2's `memory.max`, or v1's `memory.limit_in_bytes` where the memory controller
is v1's; its children, the daemon, its runner and llama-server, inherit it) and drops the
model file's page cache, so every system starts cold and holds at most that much RAM and page
cache together. Each system in turn:
  ours     the daemon: `tune --calibrate` first (the disk's read rate goes into the plan), then
           a short prompt and --tokens decoded; the plan's own figures (GiB read from disk per
           token, predicted decode) come from its load line in the daemon's log
  fit-f16  `llama-server --fit on --fit-target (free - budget)` in the same group
Rows go to $OUT/past_ram.jsonl as they are made: decode tok/s, the prediction and its error,
peak VRAM (NVML, above the baseline) and the group's peak memory (memory.peak where the kernel
has it, v1's memory.max_usage_in_bytes). Where no cgroup can be made, the RAM limit is the
daemon's `ram_budget` setting instead, and llama-server is skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


import llama_cpp  # noqa: E402, F401  (a CUDA build must load before numpy)

from scripts import synth_gguf  # noqa: E402
from scripts.bench.bench_systems import Fit, Ours  # noqa: E402
from scripts.bench.bench_tuner import MemorySampler  # noqa: E402

MIB, GIB = 1 << 20, 1 << 30
CGROUP_ROOT = Path("/sys/fs/cgroup")
PLAN_DISK = re.compile(r"([\d.]+) GiB read from disk per token at ([\d.]+) GB/s \(([^)]*)\)")
# decode after a short prompt, as the plan predicts it (its curve's first point)
PLAN_DECODE = re.compile(r"([\d.]+) tok/s at the start")


def enter_cgroup(name: str, limit_bytes: int) -> Path | None:
    """Move this process into a cgroup v2 group with memory.max = limit, or a v1 memory group
    with memory.limit_in_bytes = limit where the memory controller is v1's; None where none
    can be made (no memory controller, not allowed)."""
    v1 = CGROUP_ROOT / "memory"
    if (v1 / "memory.limit_in_bytes").is_file():
        group = v1 / name
        try:
            group.mkdir(exist_ok=True)
            swap = group / "memory.memsw.limit_in_bytes"  # RAM + swap: never below RAM's
            if swap.exists():
                swap.write_text("-1")
            (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
            if swap.exists():  # swap would hide the limit
                swap.write_text(str(limit_bytes))
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as e:
            print(f"no cgroup: {e}", file=sys.stderr)
            return None
        return group
    if not (CGROUP_ROOT / "cgroup.controllers").is_file():
        return None
    group = CGROUP_ROOT / name
    try:
        if "memory" not in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
            (CGROUP_ROOT / "cgroup.subtree_control").write_text("+memory")
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(str(limit_bytes))
        if (group / "memory.swap.max").exists():  # swap would hide the limit
            (group / "memory.swap.max").write_text("0")
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as e:
        print(f"no cgroup: {e}", file=sys.stderr)
        return None
    return group


def drop_cache(path: Path) -> None:
    """The file's pages out of the page cache, so a system reads it from disk again (and the
    pages it reads are charged to the group it runs in)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    try:  # pages another cgroup holds mapped survive fadvise; this drops every clean page
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        pass


def reset_peak(group: Path | None) -> None:
    """Linux 6.12 and later reset memory.peak on a write; older ones keep the group's peak."""
    try:
        if group:
            v1 = group / "memory.max_usage_in_bytes"
            (v1 if v1.exists() else group / "memory.peak").write_text("0")
    except OSError:
        pass


def group_peak(group: Path | None) -> int | None:
    try:
        v1 = group / "memory.max_usage_in_bytes" if group else None
        return int((v1 if v1.exists() else group / "memory.peak").read_text()) if group else None
    except (OSError, ValueError):
        return None


def disk_read_bytes(pid: int | None) -> int | None:
    """Bytes the process has had read from storage (page cache misses included, hits not)."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError, TypeError):
        pass
    return None


def plan_figures(log: Path) -> dict:
    """The load line's figures: GiB read from disk per token and the predicted decode."""
    text = log.read_text() if log.is_file() else ""
    line = next((ln for ln in text.splitlines() if "msg=\"loading " in ln), "")
    disk, decode = PLAN_DISK.search(line), PLAN_DECODE.search(line)
    out: dict = {"planned_disk_gib_per_token": float(disk.group(1)) if disk else 0.0}
    if disk:
        out["planned_disk_gbs"] = float(disk.group(2))
        out["disk_rate"] = disk.group(3)
    if decode:
        out["predicted_decode_tps"] = float(decode.group(1))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="70b", choices=tuple(synth_gguf.SHAPES))
    p.add_argument("--budget", type=float, default=12, metavar="GiB", help="VRAM")
    p.add_argument("--ram", type=float, default=24, metavar="GiB", help="the group's memory.max")
    p.add_argument("--margin", type=int, default=128, metavar="MiB")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8, help="decoded per system")
    p.add_argument("--systems", default="ours,fit-f16")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 16)
    p.add_argument("--models", default="/tmp/bench-models")
    p.add_argument("--routing", default="uniform",
                   help="MoE routers of the synthetic model: uniform, balanced, zipf:S, "
                        "local:G,S or real (docs/synthetic-routing.md)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--tiny", action="store_true",
                   help="a 1B model (0.7 GiB) on a CPU, in a group of --tiny-ram GiB where a "
                        "cgroup can be made, else with that ram_budget")
    p.add_argument("--tiny-ram", type=float, default=1.0, metavar="GiB")
    args = p.parse_args(argv)
    config = synth_gguf.SHAPES[args.shape]
    if args.tiny:
        # the smallest model that can outgrow a small ram_budget
        config, args.budget, args.ram, args.ctx, args.tokens = \
            synth_gguf.SHAPES["llama-1b"], 0.5, args.tiny_ram, 512, 16
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = synth_gguf.ensure_model(args.models, config, routing=args.routing)
    limit = int(args.ram * GIB)
    group = enter_cgroup("localllm-past-ram", limit)
    # A group's room less the tuner's 1 GiB reserve for the runner is the RAM budget; a group
    # of a tiny model's size leaves none, so --tiny names the budget too (3/4 of the group).
    budget = limit * 3 // 4 if args.tiny else limit
    settings = {} if group and not args.tiny else {
        "LOCALLLM_RAM_BUDGET": f"{max(256, budget // MIB)}MiB"}
    with open(out / "past_ram.jsonl", "a") as jsonl:
        def record(row: dict) -> None:
            row = {"shape": config.name, "model_gib": round(model.stat().st_size / GIB, 1),
                   "vram_budget_gib": args.budget, "ram_limit_gib": args.ram,
                   "limit_by": "cgroup memory.max" if group else "ram_budget setting", **row}
            jsonl.write(json.dumps(row) + "\n")
            jsonl.flush()
            print(json.dumps(row), flush=True)

        for name in args.systems.split(","):
            if name.startswith("fit-") and group is None:
                record({"system": name, "skipped": "no cgroup to hold it to the same RAM"})
                continue
            drop_cache(model)
            reset_peak(group)
            with tempfile.TemporaryDirectory() as tmp, MemorySampler() as mem:
                system = None
                try:
                    if name == "ours":
                        system = Ours(model, args.ctx, int(args.budget * 1024), args.margin,
                                      "chat", Path(tmp), "off", **settings)
                        calibrated = system.daemon.cli("tune", "bench", "--calibrate", "--ctx",
                                                       str(args.ctx), "--no-save", timeout=900)
                        if calibrated.returncode:
                            raise RuntimeError(calibrated.stderr.strip() or "calibrate failed")
                        drop_cache(model)
                    else:
                        system = Fit(model, args.ctx, int(args.budget * 1024), name[4:],
                                     args.threads, out / f"{name}-past-ram.log")
                    prompt = "The quick brown fox jumps over the lazy dog. " * 4
                    if name == "ours":  # loaded first, as llama-server is when it starts
                        system.generate(prompt, 1)
                        [loaded] = system.daemon.get("/api/ps")["models"] or [{}]
                        pid = loaded.get("runner_pid")
                    else:
                        pid = system.proc.pid
                    read_before = disk_read_bytes(pid)
                    start = time.perf_counter()
                    r = system.generate(prompt, args.tokens)
                    row = {"system": name, "decode_tps": round(r["decode_tps"], 3),
                           "answer_tokens": r["answer_tokens"], "ttft": round(r["ttft"], 1),
                           "wall_s": round(time.perf_counter() - start, 1), "plan": system.plan()}
                    read = disk_read_bytes(pid)
                    if read is not None and read_before is not None and r["answer_tokens"]:
                        # one pass over the weights per answer token (the prompt's pass
                        # gives the first); /proc/PID/io counts what reached the disk
                        row["measured_disk_gib_per_token"] = round(
                            (read - read_before) / r["answer_tokens"] / GIB, 2)
                    if name == "ours":
                        log = Path(tmp) / "xdg_state_home" / "localllm" / "logs" / "localllm.log"
                        row.update(plan_figures(log))
                        # what the runner locked in RAM and streams from the file per token
                        [loaded] = system.daemon.get("/api/ps")["models"] or [{}]
                        row["past_ram"] = loaded.get("past_ram")
                        if row.get("predicted_decode_tps") and r["decode_tps"]:
                            row["prediction_error"] = round(
                                r["decode_tps"] / row["predicted_decode_tps"] - 1, 3)
                    record(row)
                except Exception as e:  # one system failing must not lose the other's row
                    record({"system": name, "error": f"{type(e).__name__}: {e}"})
                finally:
                    if system is not None:
                        system.stop()
                    logs = Path(tmp) / "xdg_state_home" / "localllm" / "logs"
                    if logs.is_dir():  # the daemon's and runner's logs
                        shutil.copytree(logs, out / "ours-logs-past-ram", dirs_exist_ok=True)
            peak = group_peak(group)
            record({"system": name, "peak_vram_mib": mem.delta // MIB,
                    "group_peak_gib": round(peak / GIB, 2) if peak else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
