"""What happens when things go wrong: a runner dies, a client leaves, a model is deleted."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import urllib.error
import urllib.request

import ollama
import pytest
from pathlib import Path

from daemon_process import wait_for

LONG = {"num_predict": 2000, "temperature": 0.9, "seed": 3}


def loaded(daemon, name="smollm2:latest"):
    return {m["model"]: m for m in daemon.get("/api/status")["loaded"]}.get(name)


def test_killing_the_runner_mid_answer_fails_only_that_answer(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    stream = client.chat(model="smollm2", stream=True, options=LONG,
                         messages=[{"role": "user", "content": "Write a long story."}])
    next(stream)  # the answer has begun
    runner_pid = loaded(fresh_daemon)["runner_pid"]
    os.kill(runner_pid, signal.SIGKILL)
    with pytest.raises(ollama.ResponseError, match="stopped mid-answer"):
        for _ in stream:
            pass
    assert fresh_daemon.proc.poll() is None, "the daemon stays up"
    again = client.chat(model="smollm2", options={"num_predict": 8},
                        messages=[{"role": "user", "content": "Hello"}])
    assert again.message.content and again.eval_count > 0
    assert loaded(fresh_daemon)["runner_pid"] != runner_pid
    assert again.load_duration > 0, "the model was loaded again"


def test_a_runner_dying_mid_stream_ends_the_agents_streams_with_an_error(fresh_daemon):
    """Claude Code and Codex hear of a failure mid-answer as an event, never as silence."""
    import anthropic
    import openai

    story = [{"role": "user", "content": "Write a long story."}]
    claude = anthropic.Anthropic(base_url=fresh_daemon.url, api_key="x", max_retries=0)
    events = claude.messages.create(model="smollm2", max_tokens=2000, messages=story,
                                    stream=True, extra_body={"temperature": 0.9})
    assert next(iter(events)).type == "message_start"
    os.kill(loaded(fresh_daemon)["runner_pid"], signal.SIGKILL)
    with pytest.raises(anthropic.APIStatusError, match="stopped mid-answer"):
        for _ in events:
            pass
    codex = openai.OpenAI(base_url=fresh_daemon.url + "/v1", api_key="x", max_retries=0)
    stream = iter(codex.responses.create(model="smollm2", max_output_tokens=2000, input=story,
                                         stream=True, temperature=0.9))
    assert next(stream).type == "response.created"
    wait_for(lambda: loaded(fresh_daemon), timeout=60, what="the model to load again")
    os.kill(loaded(fresh_daemon)["runner_pid"], signal.SIGKILL)
    last = list(stream)[-1]
    assert last.type == "response.failed" and "stopped mid-answer" in last.response.error.message
    assert fresh_daemon.proc.poll() is None, "the daemon stays up"


def test_a_client_that_disconnects_stops_generation_soon_after(fresh_daemon):
    body = json.dumps({"model": "smollm2", "options": LONG,
                       "messages": [{"role": "user", "content": "Write a long story."}]})
    host, port = fresh_daemon.url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    conn.sendall((f"POST /api/chat HTTP/1.1\r\nHost: localhost\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                  f"{body}").encode())
    received = b""
    while received.count(b'"done": false') < 5:
        received += conn.recv(65536)
    assert loaded(fresh_daemon)["busy"]
    seen = received.count(b'"done": false')
    conn.close()
    wait_for(lambda: not loaded(fresh_daemon)["busy"], timeout=60,
             what="the runner to stop generating after the client left")
    count = loaded(fresh_daemon)["tokens_generated"]
    # Measured in tokens, not seconds (a busy machine slows both): it stopped soon after the
    # last token the client read, far before the 2,000 it asked for.
    assert count < seen + 200 < LONG["num_predict"]
    # Nothing more is generated for the departed client.
    status = fresh_daemon.get("/api/status")
    assert {m["model"]: m for m in status["loaded"]}["smollm2:latest"]["tokens_generated"] == count
    log = (fresh_daemon_state(fresh_daemon) / "logs" / "runner.log").read_text()
    assert "cancelled" in log
    # The departed request has its access-log line, as nginx spells it (499: the client
    # closed the request); aiohttp logs nothing for a handler it cancels.
    access = wait_for(lambda: [line for line in (fresh_daemon_state(fresh_daemon) / "logs"
                                                 / "localllm.log").read_text().splitlines()
                               if "logger=localllm.access" in line and " /api/chat " in line],
                      timeout=10, what="the access-log line of the cancelled request")
    assert len(access) == 1 and 'msg="POST /api/chat 499"' in access[0], access
    assert fresh_daemon.get("/api/ps")["models"], "the daemon stays up, the model loaded"


def fresh_daemon_state(daemon):
    from pathlib import Path

    return Path(daemon.env["XDG_STATE_HOME"]) / "localllm"


def test_rm_of_a_model_in_use_unloads_it_first(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 2}, keep_alive=-1)
    runner_pid = loaded(fresh_daemon)["runner_pid"]
    result = fresh_daemon.cli("rm", "smollm2")
    assert result.returncode == 0, result.stderr
    assert fresh_daemon.get("/api/ps")["models"] == []
    def runner_gone() -> bool:
        try:
            return Path(f"/proc/{runner_pid}/stat").read_text().split()[2] == "Z"
        except FileNotFoundError:
            return True

    wait_for(runner_gone, timeout=10, what="the runner to exit")
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="smollm2", prompt="hi")
    assert e.value.status_code == 404


def test_keep_alive_zero_unloads_after_the_answer_and_stop_unloads_now(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 2}, keep_alive=0)
    wait_for(lambda: fresh_daemon.get("/api/ps")["models"] == [], timeout=5,
             what="keep_alive 0 to unload")
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 2}, keep_alive="1h")
    [model] = fresh_daemon.get("/api/ps")["models"]
    assert model["expires_at"] > "2026"
    assert fresh_daemon.cli("stop", "smollm2").returncode == 0
    assert fresh_daemon.get("/api/ps")["models"] == []


def test_a_new_num_ctx_reloads_the_model(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 2, "num_ctx": 1024})
    assert fresh_daemon.get("/api/ps")["models"][0]["context_length"] == 1024
    client.generate(model="smollm2", prompt="hi", options={"num_predict": 2, "num_ctx": 2048})
    assert fresh_daemon.get("/api/ps")["models"][0]["context_length"] == 2048


def test_the_unix_socket_is_the_users_alone(fresh_daemon):
    mode = stat.S_IMODE(os.stat(fresh_daemon.socket).st_mode)
    assert mode == 0o600
    assert stat.S_IMODE(os.stat(fresh_daemon.socket.parent).st_mode) == 0o700
    # And it serves the API.
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(fresh_daemon.socket))
    s.sendall(b"GET /api/version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    assert b"200 OK" in reply and b'"version"' in reply


def test_a_non_loopback_bind_needs_an_api_key(tmp_path):
    from daemon_process import isolated_env

    import subprocess
    import sys

    env = isolated_env(tmp_path, LOCALLLM_HOST="0.0.0.0:0")
    result = subprocess.run([sys.executable, "-m", "localllm.cli", "serve"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "API key" in result.stderr and "Traceback" not in result.stderr


def test_the_api_key_is_required_over_tcp_when_set(tmp_path, smollm2_gguf):
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path, LOCALLLM_API_KEY="s3cret")
    d = start_daemon(env)
    try:
        req = urllib.request.Request(d.url + "/api/tags")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 401
        req.add_header("Authorization", "Bearer s3cret")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read()) == {"models": []}
        # The CLI reads the same key from the environment.
        assert d.cli("list").returncode == 0
    finally:
        d.stop()


def test_a_full_queue_answers_503_and_the_daemon_keeps_serving(tmp_path, smollm2_gguf):
    import threading

    from conftest import import_models
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path, LOCALLLM_MAX_QUEUE="1", LOCALLLM_NUM_PARALLEL="1")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    try:
        client = ollama.Client(host=d.url)
        first = client.generate(model="smollm2", prompt="Tell a long story.", stream=True,
                                options=LONG)
        next(first)  # holds the runner
        queued = threading.Thread(target=lambda: client.generate(
            model="smollm2", prompt="hi", options={"num_predict": 2}))
        queued.start()
        wait_for(lambda: (loaded(d) or {}).get("waiting") == 1, timeout=10,
                 what="the second request to queue")
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(model="smollm2", prompt="hi", options={"num_predict": 2})
        assert e.value.status_code == 503
        # Anthropic's clients read a busy server as overloaded_error, 529, and retry later.
        busy = urllib.request.Request(d.url + "/v1/messages", method="POST", data=json.dumps({
            "model": "smollm2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]}).encode())
        with pytest.raises(urllib.error.HTTPError) as overloaded:
            urllib.request.urlopen(busy, timeout=60)
        assert overloaded.value.code == 529 and overloaded.value.headers["Retry-After"]
        assert json.loads(overloaded.value.read())["error"]["type"] == "overloaded_error"
        first.close()
        queued.join(timeout=60)
        assert not queued.is_alive()
        assert client.generate(model="smollm2", prompt="hi", options={"num_predict": 2}).response
    finally:
        d.stop()


def test_stop_during_an_answer_ends_it_at_once(fresh_daemon):
    client = ollama.Client(host=fresh_daemon.url)
    stream = client.generate(model="smollm2", prompt="Tell a very long story.", stream=True,
                             options=LONG)
    next(stream)
    runner_pid = loaded(fresh_daemon)["runner_pid"]
    result = fresh_daemon.cli("stop", "smollm2", timeout=30)
    assert result.returncode == 0, result.stderr
    parts = list(stream)  # the stream ends (done or an error line), it does not run on
    assert parts == [] or parts[-1].done
    assert fresh_daemon.get("/api/ps")["models"] == []
    log = (fresh_daemon_state(fresh_daemon) / "logs" / "runner.log").read_text()
    assert f"runner {runner_pid} INFO request" in log and "cancelled" in log


def test_a_request_with_another_context_waits_for_the_answer_in_progress(fresh_daemon):
    import threading

    client = ollama.Client(host=fresh_daemon.url)
    first = client.generate(model="smollm2", prompt="Count from one to forty in words.",
                            stream=True, options={"num_predict": 40, "temperature": 0,
                                                  "num_ctx": 1024})
    next(first)
    other = {}
    reload = threading.Thread(target=lambda: other.update(result=client.generate(
        model="smollm2", prompt="hi", options={"num_predict": 2, "num_ctx": 2048})))
    reload.start()
    parts = list(first)
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length"), \
        "the answer ran to its end; the reload did not cancel it"
    reload.join(timeout=60)
    assert other["result"].eval_count > 0
    assert fresh_daemon.get("/api/ps")["models"][0]["context_length"] == 2048
