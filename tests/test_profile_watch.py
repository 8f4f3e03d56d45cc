"""The daemon checks edited tuned profiles as they are saved and keeps serving either way."""

from __future__ import annotations

from pathlib import Path

import ollama
import pytest

from daemon_process import wait_for


@pytest.mark.errors_expected  # the invalid profile is logged at error level, on purpose
def test_an_invalid_profile_edit_is_reported_and_the_daemon_keeps_serving(fresh_daemon):
    profiles = Path(fresh_daemon.env["XDG_CONFIG_HOME"]) / "localllm" / "profiles"
    log = Path(fresh_daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
    wait_for(profiles.is_dir, timeout=10, what="the daemon to watch the profiles dir")
    broken = profiles / "smollm2-latest@cpu-only.toml"

    def reported() -> bool:
        if log.is_file() and "tuned profile invalid" in log.read_text():
            return True
        # saved again until reported: the folder exists a moment before its watch starts, and
        # an edit made in that moment is one no watch can see (on a loaded machine, seconds)
        broken.write_text("[plan\nn_ctx = 'lots'\n")
        return False

    wait_for(reported, timeout=60, interval=0.5, what="the daemon to report the broken profile")
    answer = ollama.Client(host=fresh_daemon.url).generate(
        model="smollm2", prompt="hi", options={"num_predict": 3})
    assert answer.eval_count > 0
