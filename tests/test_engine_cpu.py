"""The engine as installed runs on this CPU: every model the suite ships decodes, the build left
AMX out (its kernels crashed on Sapphire Rapids, issue #32), and an engine that crashes at load
is named and retried without llama.cpp's extra buffer types."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from daemon_process import isolated_env, start_daemon
from conftest import import_models

# Each model loads in a process of its own, as the runner does: a crash is this test failing,
# not pytest dying.
DECODE = r"""
import sys
import llama_cpp
from localllm.engine.model import Tokenizer, load
from localllm.planner.plan import Plan

lm = load(sys.argv[1], Plan(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2))
tok = Tokenizer(lm.model, lm.vocab)
tokens = tok.tokenize("The capital of France is", add_bos=True)
prompt = (llama_cpp.llama_token * len(tokens))(*tokens)  # alive while the batch points at it
assert llama_cpp.llama_decode(lm.ctx, llama_cpp.llama_batch_get_one(prompt, len(tokens))) == 0
out = []
for _ in range(8):
    logits = llama_cpp.llama_get_logits_ith(lm.ctx, -1)
    best = max(range(lm.n_vocab), key=lambda i: logits[i])
    out.append(best)
    one = (llama_cpp.llama_token * 1)(best)
    assert llama_cpp.llama_decode(lm.ctx, llama_cpp.llama_batch_get_one(one, 1)) == 0
print(len(out), repr("".join(tok.piece(t) for t in out)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_gguf", "gemma_gguf"])
def test_every_shipped_model_decodes_with_the_installed_engine(model, request):
    """The default model (SmolLM2-135M Q4_1: the one that crashed) and the test models, with
    the extra buffer types on, as a plan loads them."""
    path = request.getfixturevalue(model)
    done = subprocess.run([sys.executable, "-c", DECODE, str(path)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (f"exit {done.returncode} decoding {path.name}:\n"
                                  f"{done.stderr[-3000:]}")
    assert done.stdout.split()[0] == "8", done.stdout


def test_the_engine_is_built_without_amx():
    built = subprocess.run([sys.executable, "-m", "localllm.engine.cpu", "--built-for"],
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    assert built.stdout.strip().endswith("no AMX"), built.stdout
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AMX_INT8 = 1" not in info, info


@pytest.fixture
def crashing_daemon(tmp_path, smollm2_gguf, request):
    env = isolated_env(tmp_path / "home", LOCALLLM_TEST_ENGINE_CRASH=request.param)
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


def _generate(daemon, model: str = "smollm2") -> tuple[int, dict]:
    body = json.dumps({"model": model, "prompt": "Hello", "stream": False,
                       "options": {"num_predict": 4, "temperature": 0}}).encode()
    request = urllib.request.Request(daemon.url + "/api/generate", body,
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=240) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _daemon_log(daemon) -> str:
    from pathlib import Path

    return (Path(daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("crashing_daemon", ["extra_bufts"], indirect=True)
def test_a_crash_at_the_first_decode_is_retried_without_extra_buffer_types(crashing_daemon):
    status, answer = _generate(crashing_daemon)
    assert status == 200, answer
    assert answer["eval_count"] > 0
    log = _daemon_log(crashing_daemon)
    assert "crashed (SIGSEGV) on this CPU" in log
    assert "retrying with llama.cpp's extra buffer types (repack, AMX) off" in log
    [model] = crashing_daemon.ps()
    assert model["extra_bufts"] is False
    shown = crashing_daemon.cli("ps")
    assert "extra buffer types (repack, AMX) off" in shown.stderr, shown.stderr
    # Later loads go without them at once: no second crash.
    crashing_daemon.cli("stop", "smollm2")
    status, _ = _generate(crashing_daemon)
    assert status == 200
    retry = "retrying with llama.cpp's extra buffer types (repack, AMX) off"
    assert _daemon_log(crashing_daemon).count(retry) == 1


@pytest.mark.slow
@pytest.mark.errors_expected
@pytest.mark.parametrize("crashing_daemon", ["always"], indirect=True)
def test_an_engine_that_crashes_either_way_is_named_with_the_cpu(crashing_daemon):
    from localllm.engine.cpu import cpu_model

    status, answer = _generate(crashing_daemon)
    assert status >= 500, answer
    message = answer["error"]
    assert "crashed (SIGSEGV) on this CPU" in message and cpu_model() in message
    assert "scripts/install.sh" in message, "it says what to do"
    ran = crashing_daemon.cli("run", "smollm2", "Hello")
    assert ran.returncode != 0
    error_lines = [ln for ln in ran.stderr.splitlines() if ln.strip()]
    assert len(error_lines) == 1 and "crashed (SIGSEGV)" in error_lines[0], ran.stderr
    assert crashing_daemon.get("/api/version")["version"], "the daemon stays up"
