"""Nothing lost when a runner dies: a request whose runner dies before its first token is
answered by a runner loaded again; the daemon's log keeps what ran and the runner's last lines;
a runner that crashed twice with a risky part of its plan on loads the next time without it."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path


from localllm.daemon.crashes import CRASHES_BEFORE_SAFER, Crashes, log_tail
from localllm.planner.plan import Plan


def _runner_pid(daemon) -> int:
    [model] = daemon.ps()
    return model["runner_pid"]


def test_a_runner_killed_while_reading_the_prompt_still_answers_the_request(fresh_daemon):
    """SIGKILL between two chunks of a long prompt, before any token: the same request is
    answered 200 with text by a runner loaded again, with no error line in the stream."""
    # ~1,200 tokens: more than two of the 512-token chunks it is read in, so a progress line
    # comes between them
    words = " ".join(f"item{i % 97} of the list" for i in range(200))
    body = json.dumps({"model": "smollm2", "prompt": words + "\nSummarise the list.",
                       "raw": True, "stream": True,
                       "options": {"num_predict": 16, "temperature": 0, "num_ctx": 2048}})
    req = urllib.request.Request(fresh_daemon.url + "/api/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    killed = None
    lines = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status == 200
        for raw in resp:
            line = json.loads(raw)
            lines.append(line)
            if killed is None and "progress" in line:  # reading the prompt: no token yet
                killed = _runner_pid(fresh_daemon)
                os.kill(killed, signal.SIGKILL)
    assert killed is not None, "the prompt was read in chunks, with progress between them"
    assert not [line for line in lines if "error" in line], lines[-3:]
    text = "".join(line.get("response", "") for line in lines)
    assert lines[-1]["done"] and lines[-1]["eval_count"] > 0 and text
    assert lines[-1]["load_duration"] > 0, "the model was loaded again within the request"
    assert _runner_pid(fresh_daemon) != killed
    log = (Path(fresh_daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" /
           "localllm.log").read_text()
    assert "died before answering" in log
    assert "the runner for smollm2:latest died" in log and "running: context" in log


def test_a_runner_killed_mid_stream_ends_it_with_an_error_and_the_next_is_served(fresh_daemon):
    body = json.dumps({"model": "smollm2", "prompt": "Write a long story.", "stream": True,
                       "options": {"num_predict": 2000, "temperature": 0.9, "seed": 3}})
    req = urllib.request.Request(fresh_daemon.url + "/api/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    lines = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            lines.append(json.loads(raw))
            if len(lines) == 3:  # tokens have gone out
                os.kill(_runner_pid(fresh_daemon), signal.SIGKILL)
    assert "stopped mid-answer" in lines[-1]["error"]
    assert not lines[-1].get("done")
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "stream": False,
                       "options": {"num_predict": 8}})
    req = urllib.request.Request(fresh_daemon.url + "/api/generate", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        again = json.loads(resp.read())
    assert again["done"] and again["response"]


def test_two_crashes_with_a_risky_part_on_load_the_model_without_it(tmp_path):
    log = tmp_path / "runner.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "CUDA error: boom\n")
    tail = log_tail(log)  # the last 40 lines
    assert tail.endswith("CUDA error: boom") and "line 61" in tail and "line 60" not in tail
    risky = Plan(n_ctx=32768, expert_cache=512, expert_misses_on_gpu=True)
    band = Plan(n_ctx=8192, expert_cache=1024, expert_misses_on_gpu=True)
    crashes = Crashes()
    crashes.record("m", risky, "killed by SIGABRT", log)
    assert crashes.safer("m", risky, (band,)) == (risky, (band,)), "one crash: as planned"
    for _ in range(CRASHES_BEFORE_SAFER - 1):
        crashes.record("m", band, "killed by SIGABRT", log)
    plan, (safer_band,) = crashes.safer("m", risky, (band,))
    assert plan.expert_cache == 512 and not plan.expert_misses_on_gpu
    assert safer_band.expert_cache == 1024 and not safer_band.expert_misses_on_gpu
    assert "misses off: the runner crashed 2 times" in crashes.notes["m"]
    assert crashes.safer("other", risky, ()) == (risky, ()), "another model: as planned"
    for _ in range(CRASHES_BEFORE_SAFER):  # crashing again with the pool alone
        crashes.record("m", plan, "killed by SIGSEGV", log)
    plan, (safer_band,) = crashes.safer("m", risky, (band,))
    assert plan.expert_cache == 0 and safer_band.expert_cache == 0
    assert "pool off" in crashes.notes["m"] and "pool off" in plan.reasons[-1]
