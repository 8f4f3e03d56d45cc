"""A profile saved by `localllm tune NAME` is the one the daemon loads NAME with, whatever
spelling of the name the user typed (`smollm2`, `SmolLM2`, `smollm2:latest`)."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import ollama


def _saved_path(stdout: str) -> Path:
    match = re.search(r"saved profile: (\S+)", stdout)
    assert match, stdout
    return Path(match.group(1))


def _edit_plan(path: Path, **changes) -> None:
    text = path.read_text()
    for key, value in changes.items():
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        assert n == 1, f"{key} not in {path}"
    path.write_text(text)


def test_a_profile_tuned_under_a_bare_name_is_loaded_with_its_edits(fresh_daemon):
    tuned = fresh_daemon.cli("tune", "smollm2")
    assert tuned.returncode == 0, tuned.stderr
    path = _saved_path(tuned.stdout)
    assert tomllib.loads(path.read_text())["model"] == "smollm2:latest"
    _edit_plan(path, n_ctx=1536, n_threads=1)
    answer = ollama.Client(host=fresh_daemon.url).generate(
        model="smollm2", prompt="hi", options={"num_predict": 2})
    assert answer.eval_count > 0
    [loaded] = fresh_daemon.ps()
    assert loaded["plan_source"] == f"profile:{path}"
    assert loaded["context_length"] == 1536 and loaded["threads"] == 1


def test_eval_and_tune_name_a_model_as_the_store_does(fresh_daemon):
    tuned = fresh_daemon.cli("tune", "SmolLM2:latest", "--json")
    assert tuned.returncode == 0, tuned.stderr
    out = json.loads(tuned.stdout)
    assert out["model"] == "smollm2:latest"
    assert Path(out["profile"]).name.startswith("smollm2-latest@")
