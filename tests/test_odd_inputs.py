"""Odd values that used to be a 500: a keep_alive of 10^15 seconds, a 10 KB import path (over
the Unix socket and over TCP)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from http.client import HTTPConnection

FOREVER = "2318-08-12T00:00:00Z"  # what /api/ps says of a model kept forever, as Ollama does


class UnixConnection(HTTPConnection):
    def __init__(self, path: str):
        super().__init__("localhost", timeout=60)
        self.path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self.path)


def test_a_keep_alive_of_a_billion_years_keeps_the_model_and_ps_answers(fresh_daemon):
    req = urllib.request.Request(fresh_daemon.url + "/api/generate", json.dumps(
        {"model": "smollm2", "prompt": "", "keep_alive": 10**15}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
    models = fresh_daemon.ps()
    assert [m["expires_at"] for m in models] == [FOREVER]


def test_a_10_kb_import_path_is_a_400_over_the_socket_and_tcp(daemon):
    path = "/" + "a" * 10_000 + ".gguf"
    body = json.dumps({"model": "long", "path": path})
    conn = UnixConnection(str(daemon.socket))
    conn.request("POST", "/api/import", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    answer = json.loads(resp.read())
    assert resp.status == 400, answer
    assert "does not exist or is not a file" in answer["error"]
    assert len(answer["error"]) < 400  # the path is shown cut, not 10 KB of it
    req = urllib.request.Request(daemon.url + "/api/import", body.encode())
    try:
        urllib.request.urlopen(req, timeout=60)
        raise AssertionError("a 10 KB path was imported")
    except urllib.error.HTTPError as e:
        assert e.code == 400 and "no such file" in json.loads(e.read())["error"]
