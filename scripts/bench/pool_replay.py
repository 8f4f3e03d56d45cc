#!/usr/bin/env python3
"""The expert cache's slot policy replayed on a synthetic model's routing: the hit rate a pool
of a given size, swaps a step and decay would have had, answer by answer, in seconds and with
no GPU.

    python -m scripts.bench.pool_replay --shape qwen3-next-80b-a3b --routing zipf:0.4 \
        --slots-per-block 94 --blocks 46 --swaps 4,8 --decay 0.95

The routing is llama.cpp's own, as bench_session.py's short run makes it: a toy of the shape
at its real depth (routing_profile.tiny_moe: the real expert count and experts per token,
toy width) reads the benchmark's short prompt in one batch and answers it greedily, and an
eval callback keeps every block's routed experts. The replay then runs `Policy`, a port of
the engine's llama-moe-cache-policy.h (tests/test_expert_cache.py holds the two to the same
swaps and counts), over that session as the benchmark asks it: the prompt learned once
(the daemon's prompt cache serves the repeats), then --answers answers of --tokens steps,
the pool shared by the last --blocks blocks. On the H200 the 80B class at zipf:0.4 hit 61.5%,
66.3%, 69.6% (2026-12-03) with 4322 slots over 46 blocks; this replay gives 61.8%, 68.3%,
73.2% (the toy's width is not the real one, so its answers differ).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np


from scripts.bench.bench_text import settle_long_prompt, short_prompt

SHORT_PROMPT = short_prompt()  # the benchmark's short prompt (bench_session.py's short run)


class Policy:
    """llama-moe-cache-policy.h in Python: decayed use counts per (layer, expert); after a step
    the missed experts, hottest first, take the free slots, then at most `max_swaps` slots of
    the coldest holders they are hotter than; then every count decays."""

    def __init__(self, n_layer: int, n_expert: int, n_slots: int, decay: float,
                 max_swaps: int, margin: float = 0.0) -> None:
        self.n_expert, self.n_slots, self.margin = n_expert, n_slots, np.float32(margin)
        self.decay, self.max_swaps = decay, max_swaps
        self.count = np.zeros(n_layer * n_expert, dtype=np.float32)
        self.slot = np.full(n_layer * n_expert, -1, dtype=np.int64)
        self.owner = np.full(n_slots, -1, dtype=np.int64)
        self.missed: list[int] = []
        self.hits = self.misses = self.swaps = self.steps = 0
        self._next_free = 0

    def observe(self, layer: int, experts) -> None:
        """A step the pool served: each lookup a hit or a miss."""
        self._count(layer, experts, served=True)

    def learn(self, layer: int, experts, weight: float = 1.0) -> None:
        """A prompt batch: uses counted `weight` each (the engine's 1/rows), no hits or
        misses."""
        self._count(layer, experts, served=False, weight=weight)

    def plan(self, served: bool = True) -> list[tuple[int, int, int]]:
        """The step's swaps as (slot, new key, old key or -1), then the decay."""
        out: list[tuple[int, int, int]] = []
        # the engine's stable sort by count, descending (float32 counts, as there)
        order = sorted(self.missed, key=lambda k: -self.count[k])
        evictions = 0
        for key in order:
            if self.n_slots == 0:
                continue
            while self._next_free < self.n_slots and self.owner[self._next_free] >= 0:
                self._next_free += 1
            victim = self._next_free if self._next_free < self.n_slots else -1
            if victim < 0:
                if evictions >= self.max_swaps:
                    continue
                victim = int(np.argmin(self.count[self.owner]))  # the first coldest
            old = int(self.owner[victim])
            if old >= 0 and not self.count[key] > self.count[old] + self.margin:
                continue
            if old >= 0:
                self.slot[old] = -1
                evictions += 1
            self.owner[victim], self.slot[key] = key, victim
            out.append((victim, key, old))
        self.missed = []
        self.count *= np.float32(self.decay)
        self.swaps += len(out)
        self.steps += served
        return out

    def _count(self, layer: int, experts, served: bool, weight: float = 1.0) -> None:
        seen = set(self.missed)
        for e in experts:
            if not 0 <= e < self.n_expert:
                continue
            key = layer * self.n_expert + int(e)
            self.count[key] += np.float32(weight)
            if self.slot[key] >= 0:
                self.hits += served
                continue
            self.misses += served
            if key not in seen:
                seen.add(key)
                self.missed.append(key)


def route_session(shape: str, routing: str, tokens: int, tmp: Path,
                  model: str | None = None, prompt: str = SHORT_PROMPT) -> tuple[dict, int, int]:
    """({block: [routed ids per token]}, prompt tokens, n_expert) of `prompt` (the short one)
    and a greedy answer of `tokens`, on a toy of `shape` at its real depth, or on `model` (a
    full-size file: the width the GPU serves, minutes on a CPU; a 12K-token prompt took 40
    minutes on two cores)."""
    from scripts.bench import routing_profile
    from scripts import synth_gguf

    path = model
    if path is None:
        config = routing_profile.tiny_moe(shape, synth_gguf.SHAPES[shape].n_layer)
        path = synth_gguf.write_gguf(tmp / "toy.gguf", config, "Q8_0", "random",
                                     routing=routing)
    blocks, n_expert, _ = routing_profile.route(str(path), prompt, n_batch=512,
                                                answer=tokens)
    return blocks, len(next(iter(blocks.values()))) - tokens, n_expert


def replay(blocks: dict, n_expert: int, slots_per_block: int, served: int,
           decay: float, swaps: int, answers: int, tokens: int,
           margin: float = 0.0, first: bool = False, ubatch: int = 0
           ) -> list[tuple[float, float]]:
    """Per answer: its own hit rate and swaps a step, the pool shared by the last `served`
    blocks (the first, with `first`: the planner keeps the first blocks' experts in RAM):
    the prompt learned in micro-batches of `ubatch` tokens (0: one batch), each a step of
    the engine's (the free slots fill at once, then `swaps` a step), then `answers` answers
    of `tokens` steps."""
    rows = served_rows(blocks, served, first)
    policy = Policy(len(rows), n_expert, slots_per_block * len(rows), decay, swaps, margin)
    # each block's answer is its last `tokens` steps: the last block routes only the prompt's
    # last token (llama.cpp computes no other row of it), so its prompt part is shorter
    longest = max(len(seq) - tokens for seq in rows)
    step = ubatch or longest
    for start in range(0, longest, step):
        for layer, seq in enumerate(rows):
            part = seq[start:min(start + step, len(seq) - tokens)]
            policy.learn(layer, [e for ids in part for e in ids], 1.0 / max(1, len(part)))
        policy.plan(served=False)
    out = []
    for _ in range(answers):
        hits, misses, swapped = policy.hits, policy.misses, policy.swaps
        for t in range(tokens):
            for layer, seq in enumerate(rows):
                policy.observe(layer, seq[len(seq) - tokens + t])
            policy.plan()
        lookups = policy.hits - hits + policy.misses - misses
        out.append(((policy.hits - hits) / max(1, lookups), (policy.swaps - swapped) / tokens))
    return out


def lru_replay(blocks: dict, slots_per_block: int, served: int, tokens: int,
               first: bool = False) -> float:
    """The hit rate of an LRU of `slots_per_block` in each served block over the answer's
    `tokens` steps, warmed by the prompt: every miss taken in (what the policy would be with
    no limit on swaps and no count to beat), the bar the policy is held to. Every block
    looks up as many experts in the answer, so the mean of the blocks' rates is the pool's."""
    from scripts.bench.routing_profile import lru_hit_rate

    rows = served_rows(blocks, served, first)
    return sum(lru_hit_rate(seq, slots_per_block, len(seq) - tokens) for seq in rows) / len(rows)


def served_rows(blocks: dict, served: int, first: bool) -> list:
    """The routed ids of the blocks a pool serves: the last `served`, or the first."""
    order = sorted(blocks)
    return [blocks[b] for b in (order[:served] if first else order[-served:])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-next-80b-a3b")
    p.add_argument("--routing", default="zipf:0.4")
    p.add_argument("--slots-per-block", type=int, default=94)
    p.add_argument("--blocks", type=int, default=46, help="blocks the pool serves (the last)")
    p.add_argument("--swaps", default="4,8", help="swaps a step at most, comma-separated")
    p.add_argument("--decay", default="0.95", help="decays, comma-separated")
    p.add_argument("--margins", default="0",
                   help="uses a newcomer must lead the coldest holder by, comma-separated")
    p.add_argument("--answers", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96, help="answer tokens (bench_session.py's)")
    p.add_argument("--model", help="route through this GGUF (a full-size synthetic file) "
                                   "instead of a toy of --shape")
    p.add_argument("--prompt-chars", type=int, default=0,
                   help="a long prompt of this many characters of the benchmark's text "
                        "(bench_session.py's first settle-long round; random letters are "
                        "about a token each) instead of the short prompt")
    p.add_argument("--ubatch", type=int, default=0,
                   help="the prompt learned in micro-batches of this many tokens, as the "
                        "engine reads it (the plan's n_ubatch); 0: in one batch")
    p.add_argument("--first", action="store_true",
                   help="the pool serves the first --blocks blocks (as the planner's "
                        "placements keep them in RAM), not the last")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        text = settle_long_prompt(args.prompt_chars) if args.prompt_chars else SHORT_PROMPT
        blocks, prompt, n_expert = route_session(args.shape, args.routing, args.tokens,
                                                 Path(tmp), args.model, text)
    print(f"{args.model or args.shape + ' ' + args.routing}: {args.slots_per_block} slots a "
          f"block over the {'first' if args.first else 'last'} {args.blocks} blocks, a prompt "
          f"of {prompt} tokens")
    lru = lru_replay(blocks, args.slots_per_block, args.blocks, args.tokens, args.first)
    print(f"  an LRU of {args.slots_per_block} a block, every miss taken in: {lru:.1%} "
          "over the first answer")
    settings = [(float(d), int(s), float(m)) for d in args.decay.split(",")
                for s in args.swaps.split(",") for m in args.margins.split(",")]
    for decay, swaps, margin in settings:
            runs = replay(blocks, n_expert, args.slots_per_block, args.blocks, decay,
                          swaps, args.answers, args.tokens, margin, args.first,
                          args.ubatch)
            n_used = len(next(iter(blocks.values()))[0])
            misses = [(1 - h) * args.blocks * n_used for h, _ in runs]
            print(f"  decay {decay:g}, {swaps:2} swaps, margin {margin:g}: "
                  + ", ".join(f"{h:.1%} ({m:.0f} misses a token, {s:.1f} swaps a step)"
                              for (h, s), m in zip(runs, misses, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
