"""`max_loaded_models` holds under concurrent loads: three requests for three models at once
with a limit of two never leave three loaded; the third load waits for a model to finish, as
Ollama's scheduler does, and every request is answered."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from daemon_process import isolated_env, start_daemon

from conftest import import_models


def test_three_models_at_once_never_load_three(tmp_path, smollm2_gguf, gemma_gguf):
    env = isolated_env(tmp_path, LOCALLLM_MAX_LOADED_MODELS="2")
    import_models(env, {"smollm2": smollm2_gguf, "gemma3-270m": gemma_gguf,
                        "smollm2-copy": smollm2_gguf})
    daemon = start_daemon(env)
    try:
        answers: dict[str, dict] = {}

        def ask(model: str) -> None:
            body = json.dumps({"model": model, "prompt": "Count to twenty.", "stream": False,
                               "raw": True, "options": {"num_predict": 24}}).encode()
            req = urllib.request.Request(daemon.url + "/api/generate", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=300) as resp:
                answers[model] = json.loads(resp.read())

        threads = [threading.Thread(target=ask, args=(m,))
                   for m in ("smollm2", "gemma3-270m", "smollm2-copy")]
        for t in threads:
            t.start()
        most = 0
        while any(t.is_alive() for t in threads):
            most = max(most, len(daemon.ps()))
            time.sleep(0.02)  # ok-sleep: the poll interval of watching a run
        for t in threads:
            t.join()
        assert most <= 2, f"{most} models were loaded at once"
        assert len(answers) == 3 and all(a["done"] for a in answers.values())
        assert len(daemon.ps()) <= 2
    finally:
        daemon.stop()
