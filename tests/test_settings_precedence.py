"""One order of precedence: what a request sets, then the daemon's env and config, then a saved
profile, then the plan. A saved `tune` profile no longer silently beats the daemon's
LOCALLLM_KV_CACHE_TYPE / LOCALLLM_NUM_PARALLEL, and ps says why it was not used."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from daemon_process import isolated_env, start_daemon

from conftest import import_models
from localllm.planner.plan import Plan
from localllm.profiles.saved import save_profile


def _generate(daemon) -> dict:
    body = json.dumps({"model": "smollm2", "prompt": "Hi", "stream": False,
                       "options": {"num_predict": 2}}).encode()
    req = urllib.request.Request(daemon.url + "/api/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_the_daemons_settings_come_before_a_saved_profile(tmp_path, smollm2_gguf):
    env = isolated_env(tmp_path, LOCALLLM_KV_CACHE_TYPE="q8_0", LOCALLLM_NUM_PARALLEL="1")
    import_models(env, {"smollm2": smollm2_gguf})
    profiles = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "profiles"
    saved = Plan(n_ctx=4096, n_gpu_layers=0, type_k="f16", type_v="f16", n_parallel=4,
                 n_threads=2, n_threads_batch=2, source="tuner")
    for card in ("cpu-only", "cpu"):  # the name this machine's probe gives its card
        save_profile(saved, "smollm2:latest", card, smollm2_gguf.stat().st_size,
                     directory=profiles)
    daemon = start_daemon(env)
    try:
        assert _generate(daemon)["done"]
        [model] = daemon.ps()
        assert model["kv_type"] == "q8_0" and model["num_parallel"] == 1
        assert not model["plan_source"].startswith("profile:")
        said = " ".join(model["plan_reasons"])
        assert "saved profile" in said and "comes before the profile's" in said, said
    finally:
        daemon.stop()
