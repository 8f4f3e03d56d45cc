"""Draft acceptance measured while serving, kept per model file and mode for the tuner."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from localllm.profiles.acceptance import DECAY_AT, MIN_DRAFTED, measured_acceptance, record


def test_a_rate_counts_once_enough_was_drafted(tmp_path):
    path = tmp_path / "acceptance.toml"
    record("m:latest", 100, "lookup", MIN_DRAFTED - 1, 10, path)
    assert measured_acceptance("m:latest", 100, path) == {}  # too few to trust
    record("m:latest", 100, "lookup", 1, 1, path)
    record("m:latest", 100, "mtp", 10, 10, path)
    assert measured_acceptance("m:latest", 100, path) == {"lookup": 11 / MIN_DRAFTED}


def test_a_new_file_under_the_name_starts_again_and_old_counts_fade(tmp_path):
    path = tmp_path / "acceptance.toml"
    record("m:latest", 100, "draft", DECAY_AT, 0, path)
    for _ in range(2):  # recent drafts all accepted
        record("m:latest", 100, "draft", DECAY_AT, DECAY_AT, path)
    assert measured_acceptance("m:latest", 100, path)["draft"] > 2 / 3  # above the plain mean
    assert measured_acceptance("m:latest", 200, path) == {}  # other weights
    record("m:latest", 200, "draft", MIN_DRAFTED, 0, path)
    assert measured_acceptance("m:latest", 200, path) == {"draft": 0.0}
    record("m:latest", 200, "bogus", 999, 999, path)  # not a mode: ignored
    assert "bogus" not in path.read_text()


def test_the_daemon_saves_what_its_answers_drafted(tmp_path, smollm2_gguf):
    from conftest import import_models
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path)
    import_models(env, {"smollm2": smollm2_gguf})
    daemon = start_daemon(env)
    prompt = "A B C D E F G H I J K L M N O P Q R S T U V W X Y Z\n" * 2 + "A B C D E F G"
    try:
        drafted = 0
        while drafted < 64:  # one flush of the daemon's counts
            body = json.dumps({"model": "smollm2", "prompt": prompt, "raw": True,
                               "stream": False, "options": {"temperature": 0, "num_predict": 96,
                                                            "speculative": "lookup"}})
            req = urllib.request.Request(daemon.url + "/api/generate", data=body.encode())
            with urllib.request.urlopen(req, timeout=300) as resp:
                done = json.loads(resp.read())
            assert done["stats"]["draft"]["drafted"] > 0
            drafted += done["stats"]["draft"]["drafted"]
    finally:
        daemon.stop()
    saved = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "profiles" / "acceptance.toml"
    text = saved.read_text()
    counts = __import__("tomllib").loads(text)["smollm2:latest"]["lookup"]
    assert counts["drafted"] >= 64 and 0 < counts["accepted"] <= counts["drafted"]
