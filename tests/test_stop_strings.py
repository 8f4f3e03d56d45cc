"""Stop strings: the earliest one wins whatever the list order, and text held back as the
possible start of a stop string reaches the client when the answer ends for another reason."""

from __future__ import annotations

import ollama
from localllm.engine.runner.slots import StopMatcher


def test_the_earliest_stop_wins_whatever_the_order():
    matcher = StopMatcher(("B", "A"))
    assert matcher.feed("xxAyyB") == ("xx", True)


def test_a_possible_stop_start_is_held_back_then_released():
    matcher = StopMatcher(("```",))
    assert matcher.feed("print(1)`") == ("print(1)", False)
    assert matcher.feed("`") == ("", False)
    assert matcher.flush() == "``"


def test_held_back_text_is_not_lost_when_the_answer_ends(daemon):
    client = ollama.Client(host=daemon.url)
    options = {"temperature": 0, "num_predict": 12}
    plain = client.generate(model="smollm2", prompt="Count to five.", options=options).response
    # A stop string that begins with the answer's last character: that character is held back
    # as a possible start, and the answer then ends by length.
    stop = plain[-1] + "\u2603\u2603"
    held = client.generate(model="smollm2", prompt="Count to five.",
                           options={**options, "stop": [stop]}).response
    assert held == plain
