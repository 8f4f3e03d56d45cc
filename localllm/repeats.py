"""Telling an answer that loops: the same stretch of text over and over at its end.

`run`'s one-shot answer, the line chat and the chat screen feed a `LoopGuard` each piece of
text as it streams, and stop the answer (closing the stream stops the model) when it loops.
"""

from __future__ import annotations

LOOP_SPAN = 240  # characters a repeated stretch must cover before it counts as a loop
LOOP_REPEATS = 4  # and the fewest times its unit must repeat
# The longest unit looked for: a paragraph said again and again (a 230-character one was
# printed 19 times before this was raised from 200).
LONGEST_UNIT = 1000


def repeating_tail(text: str, longest: int = LONGEST_UNIT) -> int:
    """The length of the unit the end of `text` repeats (`1 1 1 1 ...`, the same sentence over
    and over), when it covers LOOP_SPAN characters and LOOP_REPEATS units; else 0."""
    last = text[-1:]
    for period in range(1, longest + 1):
        repeats = max(LOOP_REPEATS, -(-LOOP_SPAN // period))
        span = period * repeats
        if span > len(text):
            break
        if text[-1 - period] != last:  # cheap first test: most periods end here
            continue
        unit = text[-period:]
        if unit.strip() and text[-span:] == unit * repeats:
            return period
    return 0


class LoopGuard:
    """Fed an answer's text piece by piece; `feed` returns the repeated unit's length once the
    answer loops, else 0. Only the end of the answer is kept."""

    KEEP = LONGEST_UNIT * LOOP_REPEATS

    def __init__(self) -> None:
        self.tail = ""

    def feed(self, text: str) -> int:
        if not text:
            return 0
        self.tail = (self.tail + text)[-self.KEEP:]
        return repeating_tail(self.tail)

    def ended(self, final: dict) -> int:
        """The unit's length when the daemon stopped the answer as a loop (done_reason "loop":
        a request with no token cap) before this guard saw it in the streamed pieces, else 0."""
        return repeating_tail(self.tail) if final.get("done_reason") == "loop" else 0

    @staticmethod
    def note(period: int) -> str:
        return f"stopped: the answer kept repeating the same {period} characters"
