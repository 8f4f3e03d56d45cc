#!/usr/bin/env python3
"""How long the plan search takes, and a digest of the plans it returns.

    .venv/bin/python -m scripts.bench.plan_speed [--repeat N] [--dump plans.json]

Plans a fixed set of cases through `tune` (every synthetic shape on 8/12/24/80 GiB cards and
two cards, the default context and 32K/128K, a paired draft model, the MoE expert pool sized
automatically, the agent workload, a request nothing fits) and prints the seconds per plan
(wall clock and CPU time) and a SHA-256 of every plan and explanation (NoPlanFits' message
where nothing fits). A change that only makes the search faster leaves the digest as it was;
--dump writes the plans themselves as JSON to compare where it does not.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]



from scripts import synth_gguf  # noqa: E402

from localllm.modelstore.shape import read_shape  # noqa: E402
from localllm.planner.card import GIB, load_card  # noqa: E402
from localllm.planner.expert_pool import AUTO_SLOTS  # noqa: E402
from localllm.planner.search import NoPlanFits, Request  # noqa: E402
from localllm.planner.tuner import tune  # noqa: E402
from localllm.planner.workload import AGENT, CHAT  # noqa: E402

HOST = dict(ram_bytes=64 * GIB, cores=8, host_bandwidth_gbs=50.0)
CARDS = ("rtx4060", "rtx3060-12g", "rtx3090", "a100-80g")
DRAFT_1B = dataclasses.replace(synth_gguf.SHAPES["llama-1b"], name="draft-1b", n_vocab=152064,
                               tied_embeddings=False)


def cases(shapes: dict, draft) -> list[tuple[str, object, object, Request, object]]:
    """(label, shape, card, request, draft shape or None)."""
    out = []
    for name, shape in shapes.items():
        for card_name in CARDS:
            card = load_card(card_name).with_host(**HOST)
            for n_ctx in (None, 32768, 131072):
                out.append((f"{name}/{card_name}/{n_ctx}", shape, card,
                            Request(n_ctx=n_ctx, workload=CHAT), None))
    big = load_card("rtx3090").with_host(**HOST)
    out.append(("dense-27b/draft", shapes["dense-27b"], big, Request(workload=CHAT), draft))
    out.append(("dense-27b/agent", shapes["dense-27b"], big, Request(workload=AGENT), None))
    out.append(("dense-27b/half-fill", shapes["dense-27b"], big, Request(), None))
    moe, small = shapes["qwen3-30b-a3b"], load_card("rtx3060-12g")
    out.append(("qwen3-30b-a3b/pool", moe, small,
                Request(expert_cache=AUTO_SLOTS, workload=CHAT), None))
    out.append(("70b/2x-rtx3090", shapes["70b"], load_card("2x-rtx3090"),
                Request(n_ctx=8192), None))
    out.append(("70b/2x-rtx3060-12g", shapes["70b"], load_card("2x-rtx3060-12g"),
                Request(n_ctx=32768, workload=CHAT), None))
    out.append(("70b/cpu-only", shapes["70b"], load_card("cpu-only"), Request(), None))
    out.append(("70b/too-big", shapes["70b"], load_card("rtx4060").with_host(8 * GIB, 4, 20.0),
                Request(n_ctx=131072, ram_budget_bytes=4 * GIB), None))
    return out


def plan_record(shape, card, request, draft) -> dict:
    try:
        return {"plan": dataclasses.asdict(tune(shape, card, request, draft=draft))}
    except NoPlanFits as e:
        return {"no_plan": str(e)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="times to plan every case")
    parser.add_argument("--dump", type=Path, help="write the plans as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = synth_gguf.ensure_headers(Path(tmp) / "headers")
        shapes = {name: read_shape(path) for name, path in paths.items()}
        draft = read_shape(synth_gguf.write_gguf(Path(tmp) / "draft-1b.gguf", DRAFT_1B,
                                                 "Q4_0", "sparse"))
    todo = cases(shapes, draft)
    records: dict[str, dict] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(args.repeat):
        for label, shape, card, request, drafter in todo:
            records[label] = plan_record(shape, card, request, drafter)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    text = json.dumps(records, sort_keys=True, default=repr)
    n = len(todo) * args.repeat
    # CPU time too: on a shared machine the wall clock counts the other processes' turns
    print(f"{n} plans in {elapsed:.2f} s ({cpu:.2f} s of CPU): {elapsed / n * 1000:.1f} ms "
          f"per plan ({cpu / n * 1000:.1f} ms of CPU)")
    print(f"digest {hashlib.sha256(text.encode()).hexdigest()}")
    if args.dump:
        args.dump.write_text(json.dumps(records, sort_keys=True, indent=1, default=repr))


if __name__ == "__main__":
    main()
