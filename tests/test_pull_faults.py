"""A hub that cannot be reached: one line naming the host, exit 1, nothing half-written; the same
through /api/pull. And a daemon killed mid-pull resumes the download after its restart."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from daemon_process import isolated_env, start_daemon, wait_for
from hub_server import FILE, REPO
from localllm.modelstore.download import DownloadOptions, HubUnreachable
from localllm.modelstore.hub import HubSettings
from localllm.modelstore.pull import pull_model
from localllm.modelstore.store import ModelStore, sha256_file


def store_of(env: dict) -> ModelStore:
    return ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")


def assert_untouched(store: ModelStore) -> None:
    """Nothing in blobs/ or manifests/, nothing left in tmp/."""
    for folder in (store.blobs, store.manifests, store.tmp):
        assert not folder.exists() or not any(folder.iterdir()), folder


def pull_cli(env: dict, name: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm.cli", "pull", name], env=env,
                          capture_output=True, text=True, timeout=120)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
    return errors[0]


@pytest.fixture
def silent_port():
    """A port that accepts connections and never answers (a hung hub)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.listen(16)
    yield server.getsockname()[1]
    server.close()


@pytest.mark.parametrize("endpoint, words", [
    ("http://127.0.0.1:9", ["127.0.0.1:9", "refused"]),
    ("http://no-such-hub.invalid", ["no-such-hub.invalid", "does not resolve"]),
])
def test_pull_from_an_unreachable_hub_is_one_line_and_exit_1(tmp_path, endpoint, words):
    env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT=endpoint)
    line = one_error_line(pull_cli(env, f"hf.co/{REPO}:Q4_1"))
    for word in words:
        assert word in line
    assert "LOCALLLM_HF_ENDPOINT" in line
    assert_untouched(store_of(env))


def test_a_tls_failure_names_the_host(tmp_path, hub):
    env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT=hub.url.replace("http://", "https://"))
    line = one_error_line(pull_cli(env, f"hf.co/{REPO}/{FILE}"))
    host = hub.url.removeprefix("http://")
    assert f"cannot reach {host}" in line and "TLS" in line
    assert_untouched(store_of(env))


def test_a_hub_5xx_is_one_line(tmp_path, hub):
    hub.server_error = 503
    env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT=hub.url)
    line = one_error_line(pull_cli(env, f"hf.co/{REPO}:Q4_1"))
    assert "HTTP 503" in line and hub.url.removeprefix("http://") in line
    assert_untouched(store_of(env))


async def test_a_hub_that_never_answers_times_out(store, silent_port):
    with pytest.raises(HubUnreachable, match=f"cannot reach 127.0.0.1:{silent_port}: it did "
                                             "not answer in time"):
        await pull_model(store, f"hf.co/{REPO}:Q4_1",
                         hub=HubSettings(f"http://127.0.0.1:{silent_port}"),
                         options=DownloadOptions(stall_timeout_s=0.5, connect_timeout_s=0.5))
    assert_untouched(store)


def test_api_pull_with_an_unreachable_hub_is_a_clean_json_error(tmp_path):
    env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT="http://127.0.0.1:9")
    d = start_daemon(env)
    try:
        for stream in (True, False):
            body = json.dumps({"model": f"hf.co/{REPO}:Q4_1", "stream": stream}).encode()
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(urllib.request.Request(d.url + "/api/pull", body),
                                       timeout=60)
            assert e.value.code == 502
            error = json.loads(e.value.read())["error"]
            assert "cannot reach 127.0.0.1:9" in error and "Traceback" not in error
        assert d.proc.poll() is None
        assert_untouched(store_of(env))
    finally:
        d.stop()


def test_a_daemon_killed_mid_pull_resumes_it_after_a_restart(tmp_path, hub, smollm2_gguf):
    env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT=hub.url)
    store = store_of(env)
    held_at = 24 << 20
    hub.hold_after = held_at  # the first download stops here until released
    d = start_daemon(env)
    body = json.dumps({"model": f"hf.co/{REPO}:Q4_1"}).encode()

    def first_pull() -> None:
        try:
            with urllib.request.urlopen(urllib.request.Request(d.url + "/api/pull", body),
                                        timeout=120) as response:
                response.read()
        except (OSError, http.client.HTTPException):
            pass  # the daemon dies under it

    client = threading.Thread(target=first_pull, daemon=True)
    client.start()

    def saved_bytes() -> int:
        for state in store.tmp.glob("download-*.json"):
            try:
                return sum(part[2] for part in json.loads(state.read_text())["parts"])
            except (OSError, ValueError):
                return 0
        return 0

    wait_for(lambda: hub.holding and saved_bytes() >= held_at, timeout=60,
             what="the pull to save its progress at the hold point")
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait(10)
    client.join(30)
    requests_before = len(hub.cdn_requests)
    hub.release()

    d = start_daemon(env)
    try:
        with urllib.request.urlopen(urllib.request.Request(
                d.url + "/api/pull", json.dumps({"model": f"hf.co/{REPO}:Q4_1",
                                                 "stream": False}).encode()),
                timeout=120) as response:
            assert json.loads(response.read()) == {"status": "success"}
        resumed = hub.cdn_requests[requests_before:]
        assert resumed == [f"bytes={held_at}-{smollm2_gguf.stat().st_size - 1}"], resumed
        entry = store.get(f"hf.co/{REPO}:Q4_1")
        assert sha256_file(entry.model_path) == sha256_file(smollm2_gguf)
        assert not list(store.tmp.glob("download-*"))
    finally:
        d.stop()


def test_an_interrupted_pull_says_what_it_kept_and_resumes(tmp_path, hub, smollm2_gguf):
    """Ctrl-C in `localllm pull` while the hub holds the download: one line says how much is
    kept and how to resume, tmp/ holds only the resumable download (no empty staging file),
    and the next pull asks the hub for the rest alone."""
    env = isolated_env(tmp_path, LOCALLLM_HF_ENDPOINT=hub.url)
    store = store_of(env)
    held_at = 24 << 20
    hub.hold_after = held_at
    name = f"hf.co/{REPO}:Q4_1"
    pull = subprocess.Popen([sys.executable, "-m", "localllm.cli", "pull", name], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def saved() -> int:
        from localllm.modelstore.download import resumable_bytes

        return resumable_bytes(store) if store.tmp.is_dir() else 0

    try:
        wait_for(lambda: hub.holding and saved() >= held_at, timeout=60,
                 what="the pull to save its progress at the hold point")
        pull.send_signal(signal.SIGINT)
        _, stderr = pull.communicate(timeout=60)
    finally:
        pull.kill()
    assert pull.returncode == 130, stderr
    last = stderr.strip().splitlines()[-1]
    from localllm.cli.pull_progress import size_text

    assert saved() >= held_at
    assert last.startswith(f"pull interrupted: {size_text(saved())} downloaded are kept in "
                           f"{store.tmp}"), stderr
    assert f"`localllm pull {name}` resumes" in last and "Traceback" not in stderr
    left = sorted(p.name.rsplit(".", 1)[-1] for p in store.tmp.iterdir())
    assert left == ["json", "partial"], left
    assert all(p.stat().st_size > 0 for p in store.tmp.iterdir())

    requests_before = len(hub.cdn_requests)
    hub.release()
    again = pull_cli(env, name)
    assert again.returncode == 0, again.stderr
    assert hub.cdn_requests[requests_before:] == [
        f"bytes={held_at}-{smollm2_gguf.stat().st_size - 1}"]
    assert sha256_file(store.get(name).model_path) == sha256_file(smollm2_gguf)
    assert not list(store.tmp.iterdir())
