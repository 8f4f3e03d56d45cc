"""`localllm run [MODEL] PROMPT`: a mistyped model is never answered by another model, and
options may sit anywhere on the line."""

from __future__ import annotations

import pytest

from localllm.cli.run import split_model_and_prompt
from localllm.errors import UserError


def no_answer_from_another_model(result, name: str) -> str:
    assert result.returncode == 1
    assert result.stdout == "", "nothing may be answered"
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: no model '{name}'")
    return lines[0]


def test_run_with_an_unknown_first_word_says_so_and_answers_nothing(daemon):
    line = no_answer_from_another_model(daemon.cli("run", "nope", "hi"), "nope")
    assert "localllm pull --list" in line and "quote the whole prompt" in line


def test_a_near_miss_offers_the_model_it_resembles(daemon):
    line = no_answer_from_another_model(daemon.cli("run", "smolm2", "hi"), "smolm2")
    assert "did you mean 'smollm2'" in line
    line = no_answer_from_another_model(daemon.cli("run", "smolm2"), "smolm2")  # alone too
    assert "did you mean 'smollm2'" in line


def test_options_anywhere_on_the_line(daemon):
    result = daemon.cli("run", "smollm2", "--ctx", "512", "Say", "hi", "--verbose",
                        timeout=300)
    try:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() and "eval rate:" in result.stderr
        assert [m["context_length"] for m in daemon.ps()
                if m["name"] == "smollm2:latest"] == [512]
    finally:  # the shared daemon's other tests expect smollm2 at its default context
        assert daemon.cli("stop", "smollm2").returncode == 0
    bad = daemon.cli("run", "smollm2", "hi", "--no-such-option")
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-option" in bad.stderr


def test_split_rules():
    def known(word):
        return word in ("smollm2", "27b-q3")

    def names():
        return ["smollm2", "27b-q3"]

    assert split_model_and_prompt(["27b-q3", "hi", "there"], "d", known, names) == (
        "27b-q3", "hi there")
    assert split_model_and_prompt(["Why is the sky blue?"], "d", known, names) == (
        "d", "Why is the sky blue?")
    assert split_model_and_prompt(["hello"], "d", known, names) == ("d", "hello")
    assert split_model_and_prompt(["What?", "now"], "d", known, names) == ("d", "What? now")
    with pytest.raises(UserError, match="no model 'hello'"):
        split_model_and_prompt(["hello", "world"], "d", known, names)
