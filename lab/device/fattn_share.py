"""Patch 0007's timing, read from test-backend-ops' perf mode (lab/device/fattn_check.sh writes
fattn-perf-0.log with the patch off and fattn-perf-1.log with it on): one token's attention per
shape, cache type and depth, off and on, and the share of a quantized type's per-query-head cost
that the shared walk is, which planner/speed.py's GPU_GROUPED_WALK_SHARE takes:

    on = off * (1 - share + share / heads)  ->  share = (1 - on / off) / (1 - 1 / heads)

    python3 -m lab.device.fattn_share RESULTS_DIR
"""

from __future__ import annotations

import re
import statistics
import sys

from pathlib import Path

LINE = re.compile(r"FLASH_ATTN_EXT\((?P<vars>[^)]*)\):\s+\d+ runs -\s+(?P<us>[\d.]+) us/run")
KEYS = ("hsk", "nh", "nr23", "kv", "nb", "type_K")


def timings(path: Path) -> dict[tuple, float]:
    """(hsk, nh, nr23, kv, nb, type_K) -> microseconds a run, for the one-token cases."""
    found = {}
    for line in path.read_text(errors="replace").splitlines():
        match = LINE.search(line)
        if not match:
            continue
        # nr23=[8,1] holds a comma: split on the commas that start a new name=
        fields = dict(part.split("=", 1) for part in re.split(r",(?=\w+=)", match["vars"]))
        if fields.get("nb") == "1":
            found[tuple(fields.get(k, "") for k in KEYS)] = float(match["us"])
    return found


def shares(off: dict[tuple, float], on: dict[tuple, float]) -> list[dict]:
    rows = []
    for key, before in sorted(off.items()):
        hsk, nh, nr23, kv, _, cache = key
        heads = int(nr23.strip("[]").split(",")[0] or 1)
        if cache == "f16" or key not in on or heads < 2:  # f16 runs the MMA kernel, unchanged
            continue
        f16 = off.get((hsk, nh, nr23, kv, "1", "f16"))
        rows.append({"type": cache, "hsk": int(hsk), "kv_heads": int(nh), "heads": heads,
                     "cells": int(kv), "off_us": before, "on_us": on[key], "f16_us": f16,
                     "share": (1 - on[key] / before) / (1 - 1 / heads)})
    return sorted(rows, key=lambda r: (r["type"], r["hsk"], r["cells"]))


def main(argv: list[str]) -> int:
    folder = Path(argv[1] if len(argv) > 1 else ".")
    logs = [folder / f"fattn-perf-{mode}.log" for mode in (0, 1)]
    missing = [str(p) for p in logs if not p.is_file()]
    if missing:
        print(f"error: no {', '.join(missing)}: run lab/device/fattn_check.sh on a GPU first")
        return 1
    rows = shares(timings(logs[0]), timings(logs[1]))
    print(f"{'type':6} {'D':>4} {'kvh':>4} {'q/kv':>4} {'cells':>6} {'off us':>8} {'on us':>8} "
          f"{'f16 us':>8} {'share':>6}")
    for r in rows:
        f16 = f"{r['f16_us']:8.1f}" if r["f16_us"] else f"{'':8}"
        print(f"{r['type']:6} {r['hsk']:4} {r['kv_heads']:4} {r['heads']:4} {r['cells']:6} "
              f"{r['off_us']:8.1f} {r['on_us']:8.1f} {f16} {r['share']:6.3f}")
    for cache in sorted({r["type"] for r in rows}):
        deep = [r["share"] for r in rows if r["type"] == cache and r["cells"] >= 16384]
        if deep:
            print(f"GPU_GROUPED_WALK_SHARE[{cache!r}] = {statistics.median(deep):.3f}"
                  f"  (median of {len(deep)} cases at 16K cells and more)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
