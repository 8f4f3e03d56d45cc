"""Who gets in: Host (DNS rebinding), Origin (CORS), the API key, the socket's file modes, and
hostile request bodies. Against a real daemon over real HTTP."""

from __future__ import annotations

import http.client
import json
import os
import socket
import stat

import pytest

from daemon_process import isolated_env, start_daemon
from localllm.daemon.security import host_allowed, origin_allowed


def call(url: str, method: str, path: str, body: bytes | None = None,
         headers: dict | None = None) -> tuple[int, dict, bytes]:
    """One raw HTTP request (http.client sets Host from the URL unless headers name one)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = dict(headers or {})
    skip_host = "Host" in headers
    try:
        conn.putrequest(method, path, skip_host=skip_host, skip_accept_encoding=True)
        for name, value in headers.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


# ---- Host ----------------------------------------------------------------------------------
@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:11435",
                                  "localhost.evil.example", "127.0.0.1.nip.io"])
def test_a_foreign_host_gets_403(daemon, host):
    status, headers, body = call(daemon.url, "GET", "/api/tags", headers={"Host": host})
    assert status == 403
    assert "not allowed" in json.loads(body)["error"]
    assert "allowed_hosts" in json.loads(body)["error"]


@pytest.mark.parametrize("host", ["localhost", "localhost:11435", "127.0.0.1:5", "[::1]:80",
                                  "app.localhost"])
def test_localhost_names_pass(daemon, host):
    status, _, body = call(daemon.url, "GET", "/api/tags", headers={"Host": host})
    assert status == 200, body
    assert "models" in json.loads(body)


def test_configured_hosts_pass_and_others_still_fail(tmp_path):
    env = isolated_env(tmp_path, LOCALLLM_ALLOWED_HOSTS="box.lan, *.home.arpa")
    d = start_daemon(env)
    try:
        for host, expected in (("box.lan", 200), ("pi.home.arpa:11435", 200),
                               ("other.lan", 403)):
            assert call(d.url, "GET", "/api/version", headers={"Host": host})[0] == expected, host
    finally:
        d.stop()


def test_host_rules():
    assert host_allowed("10.0.0.5:11435", "10.0.0.5", ())  # the bound address
    assert not host_allowed("10.0.0.6", "10.0.0.5", ())
    assert host_allowed("192.168.1.9", "0.0.0.0", ())  # any IP when bound to all of them
    assert not host_allowed("attacker.com", "0.0.0.0", ())
    assert host_allowed("", "127.0.0.1", ())  # HTTP/1.0 without Host: no name to rebind


def test_the_unix_socket_skips_the_host_check(daemon):
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        s.sendall(b"GET /api/version HTTP/1.1\r\nHost: evil.example.com\r\n"
                  b"Connection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200")


# ---- Origin / CORS ------------------------------------------------------------------------
def test_a_foreign_origin_gets_no_cors_headers_and_nothing_runs(daemon):
    body = json.dumps({"source": "smollm2", "destination": "stolen"}).encode()
    status, headers, reply = call(daemon.url, "POST", "/api/copy", body,
                                  {"Origin": "https://evil.example.com",
                                   "Content-Type": "text/plain"})
    assert status == 403
    assert not any(h.lower().startswith("access-control-") for h in headers)
    assert "origins" in json.loads(reply)["error"]
    names = [m["name"] for m in daemon.get("/api/tags")["models"]]
    assert "stolen:latest" not in names, "a simple cross-origin POST must not act"


def test_a_foreign_preflight_is_refused(daemon):
    status, headers, _ = call(daemon.url, "OPTIONS", "/api/chat", headers={
        "Origin": "https://evil.example.com", "Access-Control-Request-Method": "POST"})
    assert status == 403
    assert "Access-Control-Allow-Origin" not in headers


def test_a_localhost_origin_gets_a_correct_preflight_and_cors_on_answers(daemon):
    origin = "http://localhost:3000"
    status, headers, _ = call(daemon.url, "OPTIONS", "/api/chat", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == origin
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert "authorization" in headers["Access-Control-Allow-Headers"].lower()
    assert "Origin" in headers["Vary"]
    status, headers, _ = call(daemon.url, "GET", "/api/tags", headers={"Origin": origin})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
    # Errors are readable by the page too, and so is a stream.
    status, headers, _ = call(daemon.url, "POST", "/api/show", b"{}", {"Origin": origin})
    assert status == 400 and headers["Access-Control-Allow-Origin"] == origin
    stream = json.dumps({"model": "smollm2", "prompt": "Hi", "options": {"num_predict": 2}})
    status, headers, reply = call(daemon.url, "POST", "/api/generate", stream.encode(),
                                  {"Origin": origin})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == origin
    assert json.loads(reply.splitlines()[-1])["done"] is True


def test_listed_origins_are_allowed(tmp_path):
    env = isolated_env(tmp_path, LOCALLLM_ORIGINS="https://app.example.com,chrome-extension://*")
    d = start_daemon(env)
    try:
        for origin, expected in (("https://app.example.com", 200),
                                 ("chrome-extension://abcdef", 200),
                                 ("https://other.example.com", 403), ("null", 403)):
            status, headers, _ = call(d.url, "GET", "/api/version", headers={"Origin": origin})
            assert status == expected, origin
            assert (headers.get("Access-Control-Allow-Origin") == origin) == (expected == 200)
    finally:
        d.stop()


def test_origin_rules():
    assert origin_allowed("http://127.0.0.1:8080", ())
    assert origin_allowed("https://[::1]", ())
    assert not origin_allowed("http://localhost.evil.com", ())
    assert not origin_allowed("http://evil.com/http://localhost", ())
    assert origin_allowed("https://anything.example", ("*",))


# ---- the API key ---------------------------------------------------------------------------
def test_the_key_is_enforced_on_a_non_loopback_bind(tmp_path):
    env = isolated_env(tmp_path, LOCALLLM_HOST="0.0.0.0:0", LOCALLLM_API_KEY="s3cret-key")
    d = start_daemon(env)
    url = d.url.replace("0.0.0.0", "127.0.0.1")
    try:
        for method, path, body in (("GET", "/api/tags", None), ("GET", "/", None),
                                   ("GET", "/api/ps", None), ("GET", "/v1/models", None),
                                   ("POST", "/api/chat", b"{}"), ("POST", "/api/pull", b"{}"),
                                   ("GET", "/api/stats", None), ("GET", "/api/status", None),
                                   ("POST", "/v1/messages", b"{}")):
            status, _, reply = call(url, method, path, body)
            assert status == 401, path
            assert "API key" in json.dumps(json.loads(reply)), path
            wrong = call(url, method, path, body, {"Authorization": "Bearer s3cret-kez"})
            assert wrong[0] == 401, path
            assert call(url, method, path, body, {"x-api-key": "s3cret-kez"})[0] == 401, path
        assert call(url, "GET", "/api/version")[0] == 200  # the one open route
        status, _, reply = call(url, "GET", "/api/tags", headers={
            "Authorization": "Bearer s3cret-key"})
        assert status == 200 and json.loads(reply) == {"models": []}
        # Anthropic's clients send the key as x-api-key; a 401 there has Anthropic's shape.
        assert call(url, "GET", "/api/tags", headers={"x-api-key": "s3cret-key"})[0] == 200
        status, _, reply = call(url, "POST", "/v1/messages", b"{}")
        assert json.loads(reply)["error"]["type"] == "authentication_error"
        # A LAN client reaches it by IP: any IP literal passes the Host check on 0.0.0.0.
        assert call(url, "GET", "/api/version", headers={"Host": "192.168.7.7:1"})[0] == 200
    finally:
        d.stop()


# ---- the socket's modes --------------------------------------------------------------------
def test_the_socket_is_0600_in_a_0700_dir_even_when_the_dir_was_wider(tmp_path):
    env = isolated_env(tmp_path)
    run_dir = tmp_path / "xdg_runtime_dir" / "localllm"
    run_dir.mkdir(mode=0o755)
    os.chmod(run_dir, 0o755)
    old = os.umask(0)  # the daemon must not depend on the umask it inherits
    try:
        d = start_daemon(env)
    finally:
        os.umask(old)
    try:
        assert d.socket.parent == run_dir
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        assert stat.S_ISSOCK(os.stat(d.socket).st_mode)
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    finally:
        d.stop()


# ---- hostile bodies ------------------------------------------------------------------------
@pytest.mark.parametrize("body, words", [
    (b'{"model": "smollm2", "prompt": "\\ud800"}', "surrogate"),
    (b'{"model": "smollm2", "messages": [{"role": "user", "content": "a\\udfff"}]}',
     "surrogate"),
    (b'{"model": "smollm2", "prompt": "hi", "options": {"temperature": NaN}}', "NaN"),
    (b'{"model": "smollm2", "prompt": "hi", "options": {"top_k": 1e999}}', "out of range"),
    (b'{"model": "smollm2", "prompt": "hi", "options": {"seed": 99999999999999999999999}}',
     "out of range"),
    (b"[" * 100000 + b"]" * 100000, "nested"),
    (b'{"model": "smollm2"', "invalid JSON"),
    (b"\xff\xfe{}", "UTF-8"),
    (b"", "empty"),
    (b'"just a string"', "JSON object"),
])
def test_hostile_bodies_are_400s_that_say_why(daemon, body, words):
    status, _, reply = call(daemon.url, "POST", "/api/generate", body)
    assert status == 400, reply[:200]
    message = json.loads(reply)["error"]
    assert words in message and "Traceback" not in message


def test_a_body_past_the_cap_is_a_413(daemon):
    from localllm.daemon.api.common import MAX_BODY_BYTES

    body = b'{"model": "smollm2", "prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    status, _, reply = call(daemon.url, "POST", "/v1/completions", body)
    assert status == 413
    assert "larger than" in json.loads(reply)["error"]["message"]
    assert daemon.get("/api/version")["version"]


@pytest.mark.parametrize("name", ["../../etc/passwd", "..", "a/../../b", "/etc/passwd",
                                  "smollm2:../x", "x\x00y", "a/b/c/d/e"])
def test_no_model_name_reaches_outside_the_store(daemon, name):
    for path in ("/api/show", "/api/delete", "/api/pull"):
        method = "DELETE" if path == "/api/delete" else "POST"
        status, _, reply = call(daemon.url, method, path, json.dumps({"model": name}).encode())
        assert status in (400, 404), (path, reply)
    status, _, _ = call(daemon.url, "POST", "/api/copy",
                        json.dumps({"source": "smollm2", "destination": name}).encode())
    assert status == 400


@pytest.mark.parametrize("path", ["/etc/passwd", "/../../etc/passwd", "/static/x",
                                  "/api/../../etc/passwd", "/blobs/x", "/models/smollm2"])
def test_no_route_serves_files_by_path(daemon, path):
    status, _, reply = call(daemon.url, "GET", path)
    assert status == 404
    assert b"root:" not in reply
