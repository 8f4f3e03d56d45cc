"""Speculative decoding: how long a draft to ask for, and drafting by prompt lookup.

Drafts come from prompt lookup (here), or from a model (drafters.py: the target's own MTP
layers, or a small draft model). Prompt lookup: when the last few tokens of the context
appeared before, the tokens that followed them then are a good guess for what follows now;
"rewrite this file", quotes and code edits repeat long runs of the prompt.

The target model checks the drafts in one pass. Sampling each checked position with the
request's own sampler and keeping drafts while they equal the sample is the standard
accept/reject rule for a draft that is certain of its tokens (lookup, and the greedy drafts of
a model), so the output distribution is the target model's and greedy text is unchanged.

How many tokens to draft follows what drafting has earned so far: the acceptance measured on
this request, the measured cost of a checking pass against a plain step, and what a model
drafter spends per draft. When no length pays, drafting pauses and is tried again later.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from localllm.speculative import MAX_DRAFT

# Longest first: a longer match is a better guess. A 2-gram matches somewhere in most free text
# and its guesses mostly fail: a copy starts from 3 tokens in common.
NGRAM_SIZES = (8, 4, 3)
PAUSE_STEPS = 32  # steps without drafting after drafting stopped paying
MAX_BACKOFF = 4  # ... doubled for each pause in a row, up to 16 times as long
WINDOW = 15  # step times kept per batch size
GAIN_NEEDED = 1.03  # drafting must promise this much over plain decode (costs are estimates)
RESUME_STREAK = 8  # tokens copied in a row that resume paused prompt lookup
RESUMED_ACCEPTANCE = 0.8


class PromptLookup:
    """Where in the context the answer is copying from, found by n-gram and then followed.

    An index maps each n-gram (by hash: a collision only costs a rejected draft) to the
    position after its latest occurrence. Once a match is found, the answer is followed along
    it while it keeps copying: in a listing whose lines differ by a number, the last few
    tokens match every line, but the copy being made is the one being followed."""

    def __init__(self):
        self.index: dict[int, dict[int, int]] = {n: {} for n in NGRAM_SIZES}
        self.indexed = 0  # n-grams ending before this position are in the index
        self.cursor = -1  # history[cursor] is the token the followed copy predicts next
        self.seen = 0  # len(history) when the cursor was last moved
        self.streak = 0  # tokens the answer has copied in a row from the followed copy

    def propose(self, tokens: list[int], n: int) -> list[int]:
        """Up to n tokens the followed copy predicts next (following it first)."""
        self.follow(tokens)
        return tokens[self.cursor:self.cursor + n] if self.cursor >= 0 and n > 0 else []

    def follow(self, tokens: list[int]) -> None:
        """Move the cursor along the copy the answer is making, or find one by n-gram."""
        end = len(tokens) - 1  # the n-gram ending at the last token is the key, not indexed
        while self.indexed < end:
            i = self.indexed
            for size in NGRAM_SIZES:
                if i + 1 >= size:
                    self.index[size][hash(tuple(tokens[i + 1 - size:i + 1]))] = i + 1
            self.indexed += 1
        if self._still_copying(tokens):
            return
        self.streak = 0
        for size in NGRAM_SIZES:
            if len(tokens) > size:
                at = self.index[size].get(hash(tuple(tokens[-size:])))
                if at is not None:
                    self.cursor, self.seen = at, len(tokens)
                    return
        self.cursor = -1

    def _still_copying(self, tokens: list[int]) -> bool:
        """Whether the tokens added since the cursor moved are the copy's next ones."""
        if self.cursor < 0:
            return False
        added = len(tokens) - self.seen
        if tokens[self.seen:] != tokens[self.cursor:self.cursor + added]:
            return False
        self.cursor += added
        self.seen = len(tokens)
        self.streak += added
        return self.cursor < len(tokens) - 1


@dataclass
class StepCosts:
    """Seconds a decode step takes by how many tokens it carries, shared by the requests of one
    engine: the price of checking k drafts against a plain step; and what a model drafter
    takes per drafted token. Medians of the last few samples: one step slowed by another
    process on the machine must not turn drafting off (or on) for long."""

    # What each token a check carries beyond the first is assumed to cost, as a part of a plain
    # step, until measured: little on a GPU (weights are read once per pass), most of a step
    # on a CPU (2 cores, SmolLM2: a pass of 2 costs 1.67x one, of 4 2.5x).
    per_token_prior: float = 0.1
    samples: dict[int, collections.deque] = field(default_factory=dict)
    drafting: collections.deque = field(default_factory=lambda: collections.deque(maxlen=WINDOW))

    def record(self, n_tokens: int, elapsed: float) -> None:
        self.samples.setdefault(n_tokens, collections.deque(maxlen=WINDOW)).append(elapsed)

    def record_drafting(self, n_drafts: int, elapsed: float) -> None:
        self.drafting.append(elapsed / n_drafts)

    def seconds(self, n_tokens: int) -> float | None:
        seen = self.samples.get(n_tokens)
        return statistics.median(seen) if seen else None

    def ratio(self, n_tokens: int) -> float | None:
        """Cost of a step of n_tokens over a step of one; None until both were seen."""
        one, many = self.seconds(1), self.seconds(n_tokens)
        if one is None or many is None:
            return None
        return many / one

    def draft_ratio(self, k: int) -> float:
        """Drafting k tokens over a plain step (0 for prompt lookup: it costs no decode)."""
        one = self.seconds(1)
        return k * statistics.median(self.drafting) / one if one and self.drafting else 0.0


@dataclass
class Drafting:
    """One request's speculation: where its drafts come from ("lookup", "mtp", "draft"), its
    draft length and what drafting has earned."""

    costs: StepCosts
    mode: str = "lookup"
    max_length: int = MAX_DRAFT
    lookup: PromptLookup = field(default_factory=PromptLookup)
    length: int = 2  # short first tries: a failed check costs most where checks are dear
    acceptance: float = 0.5  # moving average of accepted / drafted
    paused: int = 0
    pauses: int = 0  # pauses in a row with no good draft between them: each one is longer
    drafted: int = 0
    accepted: int = 0

    def __post_init__(self) -> None:
        self.length = min(self.length, self.max_length)

    def wanted(self, room: int) -> int:
        """How many drafts to ask for this step (0 while drafting is paused)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return max(0, min(self.length, room))

    def propose_lookup(self, history: list[int], room: int) -> list[int]:
        """Prompt lookup's drafts. The copy is followed while drafting is paused too: an answer
        that has copied RESUME_STREAK tokens in a row from it is copying again (past the line
        it changed), and drafting resumes at once instead of waiting out the pause."""
        self.lookup.follow(history)
        if self.paused and self.lookup.streak >= RESUME_STREAK:
            self.paused, self.pauses = 0, 0
            self.acceptance = max(self.acceptance, RESUMED_ACCEPTANCE)
            self.length = max(1, self._best_length())
        return self.lookup.propose(history, self.wanted(room))

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / drafted)
        if accepted * 2 >= drafted:
            self.pauses = 0
        self.length = self._best_length()
        if self.length == 0:  # try again later, and later still if that try fails too
            self.length = min(2, self.max_length)
            self.paused = PAUSE_STEPS << min(self.pauses, MAX_BACKOFF)
            self.pauses += 1

    def _best_length(self) -> int:
        """The draft length with the most tokens per second of step time: a step with k
        drafts yields (1 - a^(k+1)) / (1 - a) tokens on average at acceptance a, and costs a
        check of k + 1 tokens plus, for a model drafter, k draft steps."""
        a = min(self.acceptance, 0.99)
        best, best_rate = 0, GAIN_NEEDED  # plain decode: one token per plain step
        for k in (1, 2, 3, 4, 6, MAX_DRAFT):
            if k > self.max_length:
                break
            ratio = self.costs.ratio(1 + k)
            if ratio is None:
                ratio = 1.0 + self.costs.per_token_prior * k  # until measured
            rate = (1 - a ** (k + 1)) / (1 - a) / (ratio + self.costs.draft_ratio(k))
            if rate > best_rate:
                best, best_rate = k, rate
        return best
