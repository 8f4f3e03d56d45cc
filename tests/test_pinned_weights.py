"""What holds the weights in RAM is reported as it really ran. A plan on a GPU pins them in place
(engine/host_pin.py); where the driver refuses, the runner copies them instead (load_mode none),
and /api/ps, `localllm ps` and the log say so. No CUDA here: a saved profile asks for the pin on
the CPU, which can never grant it, so the fallback runs for real."""

from __future__ import annotations

import re
from pathlib import Path

import ollama

from daemon_process import wait_for


def test_a_refused_pin_copies_the_weights_and_ps_says_what_holds_them(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 2})
    [plain] = fresh_daemon.ps()
    assert plain["weights_in_ram"] == "mapped" and plain["pin_in_place"] is False

    tuned = fresh_daemon.cli("tune", "smollm2")  # saves the profile the next load uses
    assert tuned.returncode == 0, tuned.stderr
    profiles = Path(fresh_daemon.env["XDG_CONFIG_HOME"]) / "localllm" / "profiles"
    [profile] = profiles.glob("smollm2*.toml")
    text = profile.read_text()
    assert re.search(r"(?m)^pin_in_place = false$", text), text
    profile.write_text(re.sub(r"(?m)^pin_in_place = false$", "pin_in_place = true", text))
    assert fresh_daemon.cli("stop", "smollm2").returncode == 0
    wait_for(lambda: not fresh_daemon.ps(), timeout=30, what="the model to unload")

    answer = client.generate(model="smollm2", prompt="hi", options={"num_predict": 2})
    assert answer.eval_count > 0  # the copy serves
    [pinned] = fresh_daemon.ps()
    assert pinned["pin_in_place"] is True and pinned["weights_in_ram"] == "copied"
    ps = fresh_daemon.cli("ps")
    assert "weights in RAM: copied into pinned memory, as the driver refused" in ps.stderr
    log = Path(fresh_daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
    assert "the driver refused: they were copied into pinned memory" in log.read_text()
