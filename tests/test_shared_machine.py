"""A machine shared with other users, hostile templates, and faults that used to end in a 500
or a hang. Against a real daemon over real HTTP, with a real second local user where the tests
run as root."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import import_models
from daemon_process import isolated_env, start_daemon
from localllm.daemon.security import find_uid, parse_address

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="a second local user needs root to "
                               "create (useradd) and to run as (runuser)")


# ---- helpers -------------------------------------------------------------------------------
def post(url: str, path: str, body: dict, headers: dict | None = None,
         timeout: float = 120, method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method=method,
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
            return response.status, json.loads(text.splitlines()[-1]) if text else {}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path):
        super().__init__("localhost", timeout=60)
        self.socket_path = str(path)

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.socket_path)


def post_unix(sock: Path, path: str, body: dict) -> tuple[int, dict]:
    conn = UnixHTTPConnection(sock)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def other_user():
    """A throwaway local user, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a second local user needs root to create (useradd)")
    name = f"llprobe{uuid.uuid4().hex[:6]}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False)


def as_user(user: str, *command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *command], capture_output=True,
                          text=True, timeout=60)


def curl_as(user: str, url: str, *extra: str) -> tuple[int, str]:
    done = as_user(user, "curl", "-s", "-w", "\n%{http_code}", *extra, url)
    body, _, code = done.stdout.rpartition("\n")
    return int(code or 0), body


# ---- other users ---------------------------------------------------------------------------
def test_the_kernel_socket_table_names_the_peer():
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid\n"
    client = ("   0: 0100007F:D431 0100007F:2CAB 01 00000000:00000000 00:00000000 00000000  "
              "1001        0 12345 1 0000000000000000 20 4 0 10 -1\n")
    server = ("   1: 0100007F:2CAB 0100007F:D431 01 00000000:00000000 00:00000000 00000000  "
              "   0        0 12346 1 0000000000000000 20 4 0 10 -1\n")
    import ipaddress

    ip = ipaddress.ip_address("127.0.0.1")
    assert parse_address("0100007F:2CAB") == (ip, 0x2CAB)
    assert find_uid(header + server + client, (ip, 0xD431), (ip, 0x2CAB)) == 1001
    assert find_uid(header + server, (ip, 0xD431), (ip, 0x2CAB)) is None


@ROOT_ONLY
def test_another_user_needs_the_key_and_cannot_read_the_store(tmp_path, other_user,
                                                              smollm2_gguf):
    env = isolated_env(tmp_path / "open")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    try:
        code, body = curl_as(other_user, d.url + "/api/tags")
        assert code == 403, body
        error = json.loads(body)["error"]
        assert "another user" in error and "api_key" in error
        assert d.get("/api/tags")["models"]  # the owner, over the same TCP port
        assert curl_as(other_user, d.url + "/api/version")[0] == 200  # says nothing
        # The store: nothing of it is open to the other user, blobs included.
        store = Path(env["XDG_DATA_HOME"]) / "localllm" / "models"
        blob = next((store / "blobs").glob("sha256-*"))
        assert as_user(other_user, "cat", str(blob)).returncode != 0
        assert as_user(other_user, "ls", str(store / "manifests")).returncode != 0
    finally:
        d.stop()
    env = isolated_env(tmp_path / "keyed", LOCALLLM_API_KEY="s3cret")
    d = start_daemon(env)
    try:
        assert curl_as(other_user, d.url + "/api/tags")[0] == 403
        code, body = curl_as(other_user, d.url + "/api/tags", "-H",
                             "Authorization: Bearer s3cret")
        assert code == 200 and "models" in json.loads(body)
    finally:
        d.stop()


def test_store_is_owner_only_and_imports_never_change_their_source(tmp_path, smollm2_gguf):
    env = isolated_env(tmp_path / "d", LOCALLLM_IMPORT_DIRS=str(tmp_path / "src"))
    d = start_daemon(env)
    (tmp_path / "src").mkdir()
    wide = tmp_path / "src" / "wide.gguf"
    shutil.copyfile(smollm2_gguf, wide)
    os.chmod(wide, 0o644)
    try:
        code, data = post(d.url, "/api/import", {"model": "wide", "path": str(wide)})
        assert code == 200, data
        store = Path(env["XDG_DATA_HOME"]) / "localllm" / "models"
        blob = next((store / "blobs").glob("sha256-*"))
        assert mode(wide) == 0o644  # the user's file keeps its mode ...
        assert blob.stat().st_ino != wide.stat().st_ino  # ... because it was copied
        assert mode(blob) == 0o600
        manifest = store / "manifests" / "wide" / "latest"
        assert mode(manifest) == 0o600
        for folder in (store, store / "blobs", store / "manifests", manifest.parent, store / "tmp"):
            assert mode(folder) == 0o700, folder
        assert post(d.url, "/api/delete", {"model": "wide"}, method="DELETE")[0] == 200
        private = tmp_path / "src" / "private.gguf"
        shutil.copyfile(smollm2_gguf, private)
        os.chmod(private, 0o600)
        code, data = post(d.url, "/api/import", {"model": "private", "path": str(private)})
        assert code == 200, data
        blob = next((store / "blobs").glob("sha256-*"))
        assert blob.stat().st_ino == private.stat().st_ino  # 0600 and ours: linked, no copy
        assert mode(private) == 0o600
    finally:
        d.stop()


def test_tcp_paths_must_be_in_import_dirs_and_never_tell_what_exists(tmp_path, smollm2_gguf):
    allowed, private = tmp_path / "allowed", tmp_path / "private"
    allowed.mkdir()
    private.mkdir(mode=0o700)
    secret = private / "secret.gguf"
    shutil.copyfile(smollm2_gguf, secret)
    os.chmod(secret, 0o600)
    env = isolated_env(tmp_path / "d", LOCALLLM_IMPORT_DIRS=str(allowed))
    d = start_daemon(env)
    try:
        answers = []
        for path in (secret, private / "missing.gguf", allowed / "missing.gguf",
                     allowed / ".." / "private" / "secret.gguf"):
            code, data = post(d.url, "/api/import", {"model": "x", "path": str(path)})
            answers.append((code, data["error"].replace(str(path), "PATH")))
            code, data = post(d.url, "/api/create", {"model": "y", "modelfile": f"FROM {path}"})
            answers.append((code, data["error"].replace(str(path), "PATH")))
        assert {a[0] for a in answers} == {400}
        assert len({a[1] for a in answers}) == 1, answers  # one message: exists or not
        assert "import_dirs" in answers[0][1]
        names = {m["name"] for m in d.get("/api/tags")["models"]}
        assert not names & {"x:latest", "y:latest"}
        shutil.copyfile(smollm2_gguf, allowed / "ok.gguf")
        code, data = post(d.url, "/api/create", {"model": "y", "modelfile":
                                                 f"FROM {allowed / 'ok.gguf'}"})
        assert code == 200, data
        # The Unix socket is the owner's alone: any of their files may be named there.
        code, data = post_unix(d.socket, "/api/import", {"model": "x", "path": str(secret)})
        assert code == 200, data
    finally:
        d.stop()


def test_the_default_import_dir_is_home():
    from localllm.config import Config

    assert Config().import_roots == (Path.home().resolve(),)


def test_config_holding_the_api_key_is_written_0600(tmp_path):
    env = isolated_env(tmp_path)
    done = subprocess.run([sys.executable, "-m", "localllm.cli", "config", "set", "api_key",
                           "s3cret"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    path = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "config.toml"
    assert "s3cret" in path.read_text() and mode(path) == 0o600


# ---- hostile templates ---------------------------------------------------------------------
def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))


def test_hostile_templates_get_a_400_naming_the_limit_and_others_keep_being_served(
        fresh_daemon):
    d = fresh_daemon
    hostile = {
        # 800M iterations, far past the 2 s limit anywhere (80M once rendered in 1.8 s here);
        # the sandbox refuses a single range over 100,000
        "spin": "{% for i in range(100000) %}{% for j in range(8000) %}{% endfor %}{% endfor %}",
        "big": '{{ "a" * 60000000 }}',
        "huge": '{{ "a" * 10**10 }}',
    }
    for name, template in hostile.items():
        code, data = post(d.url, "/api/create", {"model": name, "from": "smollm2",
                                                 "template": template})
        assert code == 200, data
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": False,
            "options": {"num_predict": 1}}
    result: dict = {}
    spinning = threading.Thread(target=lambda: result.update(
        answer=post(d.url, "/api/chat", {"model": "spin", **chat})))
    started = time.monotonic()
    spinning.start()
    try:
        version = d.get("/api/version")  # while the render runs
        answered_while_rendering = spinning.is_alive()
    finally:
        spinning.join(timeout=120)
    assert version["version"] and answered_while_rendering
    code, data = result["answer"]
    assert code == 400 and "time limit" in data["error"], data
    assert time.monotonic() - started < 60
    before = rss_kib(d.proc.pid)
    for name in ("big", "huge"):
        code, data = post(d.url, "/api/chat", {"model": name, **chat})
        assert code == 400 and "size limit" in data["error"], data
    assert rss_kib(d.proc.pid) - before < 200_000  # the daemon did not hold the string
    code, data = post(d.url, "/api/chat", {"model": "smollm2", **chat})
    assert code == 200, data


# ---- faults --------------------------------------------------------------------------------
def test_importing_proc_self_mem_is_a_4xx(fresh_daemon):
    code, data = post_unix(fresh_daemon.socket, "/api/import",
                           {"model": "mem", "path": "/proc/self/mem"})
    assert 400 <= code < 500 and "not a GGUF" in data["error"], data
    code, data = post(fresh_daemon.url, "/api/import", {"model": "mem", "path": "/proc/self/mem"})
    assert 400 <= code < 500, data


@pytest.fixture
def small_disk(tmp_path):
    """A 200 MiB tmpfs, mounted for the test (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200m", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_507_and_leaves_nothing_half_written(tmp_path, small_disk,
                                                              smollm2_gguf):
    store = small_disk / "models"
    env = isolated_env(tmp_path / "d", LOCALLLM_MODELS=str(store))
    import_models_at(store, smollm2_gguf)  # 94 MiB of the 200
    d = start_daemon(env)
    try:
        payload = os.urandom(120 << 20)  # more than is left
        import hashlib

        digest = "sha256:" + hashlib.sha256(payload).hexdigest()
        request = urllib.request.Request(f"{d.url}/api/blobs/{digest}", data=payload,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                code, data = response.status, {}
        except urllib.error.HTTPError as e:
            code, data = e.code, json.loads(e.read() or b"{}")
        except (ConnectionError, urllib.error.URLError) as e:
            pytest.fail(f"the daemon dropped the upload instead of answering: {e}")
        assert code == 507 and "disk" in data["error"] and "full" in data["error"], data
        assert not list((store / "tmp").iterdir())
        assert len(list((store / "blobs").iterdir())) == 1
        # Fill what is left, then /api/copy has no room for its manifest.
        filler = small_disk / "filler"
        with filler.open("wb") as f, pytest.raises(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        code, data = post(d.url, "/api/copy", {"source": "smollm2", "destination": "again"})
        assert code == 507 and "full" in data["error"], data
        names = {m["name"] for m in d.get("/api/tags")["models"]}
        assert names == {"smollm2:latest"}
        assert not [p for p in (store / "manifests").rglob("*") if p.name.startswith(".")]
    finally:
        d.stop()


def test_an_import_too_big_to_copy_is_refused_before_writing_and_links_once_private(
        small_disk, smollm2_gguf):
    from localllm.modelstore.store import DiskFull, ModelStore

    store = ModelStore(small_disk / "models")
    source = small_disk / "smollm2.gguf"  # 94 MiB, on the store's filesystem
    shutil.copyfile(smollm2_gguf, source)
    os.chmod(source, 0o644)  # others may read it: an import copies it
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (80 << 20))  # leaves about 26 MiB
    with pytest.raises(DiskFull) as refused:
        store.import_gguf(source, "smollm2")
    message = str(refused.value)
    from localllm.units import human_size

    assert f"copies {human_size(source.stat().st_size)}" in message, message
    assert "MB free" in message, message
    assert f"chmod 600 {source}" in message, message
    assert not list((store.root / "tmp").iterdir()), "nothing was half-written"
    assert store.list() == []
    os.chmod(source, 0o600)
    entry = store.import_gguf(source, "smollm2")  # linked: it takes no room
    assert os.path.samefile(entry.model_path, source)


def import_models_at(store: Path, gguf: Path) -> None:
    from localllm.modelstore.store import ModelStore

    ModelStore(store).import_gguf(gguf, "smollm2", link=False)


def test_a_truncated_blob_of_a_loaded_model_is_a_409_naming_it(fresh_daemon):
    d = fresh_daemon
    body = {"model": "smollm2", "prompt": "hi", "stream": False, "options": {"num_predict": 1}}
    assert post(d.url, "/api/generate", body)[0] == 200
    blob = next((Path(d.env["XDG_DATA_HOME"]) / "localllm" / "models" / "blobs").glob("sha256-*"))
    data = blob.read_bytes()
    blob.unlink()  # the test model is linked in: cut a copy, never the original
    blob.write_bytes(data[: len(data) // 2])
    code, answer = post(d.url, "/api/generate", body)
    assert code == 409, answer
    assert "smollm2" in answer["error"] and "pull or import it again" in answer["error"]


class RecordQueue(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


async def test_a_non_utf8_config_is_refused_and_the_watcher_lives_on(home):
    from localllm.config import Config, config_file, load_config
    from localllm.daemon.config_watch import watch_config

    path = config_file()
    path.parent.mkdir(parents=True)
    path.write_text('keep_alive = "5m"\n')
    applied: asyncio.Queue[Config] = asyncio.Queue()
    log = logging.getLogger("test.shared_machine.watch")
    log.propagate = False
    records = RecordQueue()
    log.addHandler(records)
    task = asyncio.create_task(watch_config(path, applied.put_nowait, log,
                                            initial=load_config(path)))

    def save(data: bytes) -> None:
        draft = path.with_name(".config.toml.draft")
        draft.write_bytes(data)
        draft.replace(path)

    try:
        deadline = time.monotonic() + 20
        while not any("UTF-8" in r.getMessage() for r in records.records):
            assert time.monotonic() < deadline, "the bad edit was never reported"
            save(b'keep_alive = "\xff\xfe"\n')  # again until the watcher is listening
            await asyncio.sleep(0.2)  # ok-sleep: the poll interval of a deadline loop
        assert not task.done()
        save(b'keep_alive = "30s"\n')
        new = await asyncio.wait_for(applied.get(), 20)
        assert new.keep_alive_seconds == 30.0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_a_long_chat_is_truncated_by_counting_each_turn_once(fresh_daemon):
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(500):
        messages += [{"role": "user", "content": f"Question {i}: what is {i} plus one?"},
                     {"role": "assistant", "content": f"It is {i + 1}."}]
    messages.append({"role": "user", "content": "Last question: name a colour."})
    assert len(messages) == 1002  # the system prompt and 1,001 turns' messages
    body = {"model": "smollm2", "messages": messages, "stream": False,
            "options": {"num_ctx": 2048, "num_predict": 4, "temperature": 0}}
    code, data = post(fresh_daemon.url, "/api/chat", body, timeout=600)
    assert code == 200, data
    # most of the context, kept whole (a small one: the turns it keeps are read as a prompt)
    assert 1000 < data["prompt_eval_count"] <= 2048 - 4
    # Each turn counted once, then a few renders to confirm: not one per dropped turn.
    log = Path(fresh_daemon.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log"
    line = next(x for x in log.read_text().splitlines() if "turns to fit" in x)
    renders = int(line.split("(")[1].split()[0])
    assert renders <= 4, line


def test_soak_counts_embeddings_and_sse_comments_as_answers(fresh_daemon):
    import argparse

    import aiohttp
    from scripts import soak

    args = argparse.Namespace(duration=60, kill_every=0, timeout=120, clients=1,
                              max_requests=10, max_tokens=4, seed=0, store="")
    runner = soak.Soak(fresh_daemon.url, "smollm2", args)

    async def drive() -> None:
        async with aiohttp.ClientSession() as session:
            await runner.probe_embed(session)
            assert runner.has_embed
            await runner.one(session, "embed")
            # A prompt longer than a batch streams `: prompt N/M` comments before its tokens.
            body = {"model": "smollm2", "stream": True, "max_tokens": 2,
                    "messages": [{"role": "user", "content": "word " * 1500}]}
            async with session.post(fresh_daemon.url + "/v1/chat/completions",
                                    json=body) as response:
                lines = [raw.decode().strip() async for raw in response.content]
            assert any(line.startswith(": prompt ") for line in lines)  # the case to count
            async with session.post(fresh_daemon.url + "/v1/chat/completions",
                                    json=body) as response:
                await runner.read_stream(response, "/v1/chat/completions", "openai-chat-stream",
                                         time.monotonic())

    asyncio.run(drive())
    assert runner.tally.answered == 1 and not runner.tally.failures, runner.tally.failures
