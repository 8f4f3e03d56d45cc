"""How long a draft to ask for (pure logic: no model). The engine measures step times; these
tests feed it times and acceptances and check the decisions."""

from __future__ import annotations

from localllm.engine.runner.speculation import (
    MAX_DRAFT,
    PAUSE_STEPS,
    Drafting,
    PromptLookup,
    StepCosts,
)


def costs(one: float, per_token: float) -> StepCosts:
    c = StepCosts()
    for n in range(1, MAX_DRAFT + 2):
        for _ in range(3):
            c.record(n, one + per_token * (n - 1))
    return c


def test_high_acceptance_and_cheap_checks_draft_long():
    d = Drafting(costs(0.010, 0.0005))
    for _ in range(10):
        d.record(d.length, d.length)
    assert d.length == MAX_DRAFT
    assert d.wanted(room=100) == MAX_DRAFT
    assert d.wanted(room=3) == 3


def test_drafts_that_never_match_pause_drafting():
    d = Drafting(costs(0.010, 0.0005))
    for _ in range(12):
        if d.paused:
            break
        d.record(max(d.length, 1), 0)
    assert d.paused == PAUSE_STEPS
    assert all(d.wanted(room=100) == 0 for _ in range(PAUSE_STEPS))
    n = d.wanted(room=100)
    assert n > 0  # tried again after the pause
    d.record(n, 0)  # and failed again: a longer pause
    assert d.paused == 2 * PAUSE_STEPS


def test_expensive_checks_ask_for_short_drafts_or_none():
    """A check costing nearly a plain step per token (layers on a CPU) pays only at very high
    acceptance: at 60% acceptance drafting stops."""
    d = Drafting(costs(0.010, 0.009))
    for _ in range(8):
        if d.paused:
            break
        d.record(max(d.length, 1), round(0.6 * max(d.length, 1)))
    assert d.paused


def test_a_draft_model_as_costly_as_the_target_never_pays():
    c = costs(0.010, 0.0005)
    for _ in range(3):
        c.record_drafting(4, 0.040)  # one target step per draft token
    d = Drafting(c, mode="draft")
    for _ in range(5):
        if d.paused:
            break
        d.record(max(d.length, 1), max(d.length, 1))
    assert d.paused


def test_one_slow_step_does_not_move_the_estimate():
    c = costs(0.010, 0.001)
    c.record(1, 5.0)  # another process took the cores for a moment
    assert abs(c.ratio(5) - 1.4) < 0.05


def test_lookup_follows_the_copy_it_is_making():
    """Lines differ by a number only: the last few tokens match every line, but once the answer
    copies line 2, the drafts continue line 2, not the latest line with the same ending."""
    lines = [[100 + i, 7, 8, 9, 50] for i in range(4)]  # [number, shared..., newline]
    prompt = [1] + [t for line in lines for t in line]
    lookup = PromptLookup()
    history = prompt + [101]  # the answer starts copying line 1
    assert lookup.propose(history, 4) == [7, 8, 9, 50]
    history += [7, 8, 9, 50]
    assert lookup.propose(history, 3) == [102, 7, 8]  # the next line of the copy
    history += [102, 7, 8, 9, 50, 999]  # the answer departs from the listing
    assert lookup.propose(history, 3) == []
