"""The benchmarks' prompt text: seeded words that do not repeat.

A repeated list of words routes an MoE model to the same experts over and over (a cache's
decode was seen to double over real text's), so the benchmarks read random letters in words of
2-10, with commas and full stops: the only reuse left is what the routing itself makes
(docs/synthetic-routing.md).
"""

from __future__ import annotations

import random

SHORT_CHARS = 270  # the short prompt: about a paragraph
LETTERS = "etaoinshrdlcumwfgypbvkjxqz"
WEIGHTS = [12, 9, 8, 8, 7, 7, 6, 6, 6, 4, 4, 3, 3, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1]


def text_of(n_chars: int, seed: int) -> str:
    """`n_chars` of words of random letters (English letter frequencies), the same for a seed."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n_chars:
        word = "".join(rng.choices(LETTERS, WEIGHTS, k=rng.randint(2, 10)))
        word += rng.choice(("", "", "", "", "", "", ",", "."))
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:n_chars]


def short_prompt(seed: int = 0) -> str:
    """The short prompt of bench_session's `short` run."""
    return text_of(SHORT_CHARS, seed)


SETTLE_LONG_SEED = 40  # bench_session's settle-long rounds read seeds 40, 41, ...


def settle_long_prompt(n_chars: int, round_: int = 0) -> str:
    """A long prompt of bench_session's settle-long rounds (a new one each round)."""
    return text_of(n_chars, SETTLE_LONG_SEED + round_)
