"""Hypothesis against a real daemon: every JSON route gets mutated and random bodies. No answer
may be a 5xx (503 is allowed: a full queue; 502 on /api/pull: the hub is unreachable, which the
fuzz daemon's hub always is), none may carry traceback or "internal error" text, and the daemon
is up afterwards.

Kept cheap on purpose: generation is capped at a few tokens and num_ctx stays small (a fuzzed
16M-token context would measure the machine's memory, not the API's checks); the hub is a closed
port, so no pull leaves this machine.
"""

from __future__ import annotations

import http.client
import json
import re

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from daemon_process import isolated_env, start_daemon
from localllm.modelstore import catalog

pytestmark = pytest.mark.slow

ROUTES = {  # path -> (method, a valid body to mutate)
    "/api/generate": ("POST", {"model": "smollm2", "prompt": "Hi", "stream": False,
                               "options": {"num_predict": 2, "temperature": 0.5}}),
    "/api/chat": ("POST", {"model": "smollm2", "stream": True, "options": {"num_predict": 2},
                           "messages": [{"role": "user", "content": "Hi"}]}),
    "/api/show": ("POST", {"model": "smollm2"}),
    "/api/copy": ("POST", {"source": "smollm2", "destination": "fuzz-copy"}),
    "/api/delete": ("DELETE", {"model": "fuzz-copy"}),
    "/api/import": ("POST", {"model": "fuzz-import", "path": "/nonexistent.gguf"}),
    "/api/pull": ("POST", {"model": "hf.co/fuzz/repo:Q4_K_M", "stream": True}),
    "/v1/chat/completions": ("POST", {"model": "smollm2", "max_tokens": 2, "stream": False,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
    "/v1/completions": ("POST", {"model": "smollm2", "prompt": "Hi", "max_tokens": 2,
                                 "stream": True}),
    "/v1/messages": ("POST", {"model": "smollm2", "max_tokens": 2, "stream": True,
                              "system": "Be brief.",
                              "messages": [{"role": "user", "content": "Hi"}]}),
    "/v1/responses": ("POST", {"model": "smollm2", "max_output_tokens": 2, "stream": True,
                               "instructions": "Be brief.",
                               "input": [{"role": "user", "content": "Hi"}]}),
}
GET_ROUTES = ["/api/version", "/api/tags", "/api/ps", "/api/status", "/api/stats", "/v1/models"]
STORED = {"smollm2", "smollm2:latest"}

scalars = (st.none() | st.booleans() | st.integers() | st.integers(-(2**70), 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
           | st.sampled_from(["smollm2", "", "../x", "a" * 300, "nope", "hf.co/a/b:Q4"]))
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                           | st.dictionaries(st.text(max_size=10), kids, max_size=3),
                           max_leaves=8)


@st.composite
def mutated(draw, template: dict) -> dict:
    """The template with some fields replaced, removed or nested ones fuzzed, and extra keys."""
    body = {}
    for key, value in template.items():
        choice = draw(st.sampled_from(["keep", "keep", "replace", "drop", "deep"]))
        if choice == "keep":
            body[key] = value
        elif choice == "replace":
            body[key] = draw(json_values)
        elif choice == "deep" and isinstance(value, dict):
            body[key] = {**value, **draw(st.dictionaries(
                st.sampled_from(["temperature", "top_k", "top_p", "min_p", "seed", "stop",
                                 "num_ctx", "repeat_last_n", "num_gpu", "typical_p",
                                 "repeat_penalty", "num_batch", "num_thread"]),
                json_values, max_size=3))}
        elif choice == "deep" and isinstance(value, list):
            body[key] = draw(st.lists(st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | scalars,
                 "content": json_values}), max_size=3))
    body.update(draw(st.dictionaries(st.text(max_size=10), json_values, max_size=2)))
    return body


def cheap(path: str, body: dict) -> dict:
    """Keep a fuzzed body from asking for real work: a few tokens, a small context, no pull
    that would leave the machine, no delete of the model the other examples use."""
    options = body.get("options")
    if isinstance(options, dict):
        if not isinstance(options.get("num_predict"), str):
            options["num_predict"] = 2
        ctx = options.get("num_ctx")
        if isinstance(ctx, int | float) and not isinstance(ctx, bool) and ctx > 2048:
            options["num_ctx"] = 2048
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        if key in body and isinstance(body[key], int) and not isinstance(body[key], bool):
            body[key] = 2
    if path == "/v1/responses":
        body["max_output_tokens"] = 2
    elif body.get("max_tokens") is None and path.startswith("/v1/"):
        body["max_tokens"] = 2
    if path.startswith(("/api/generate", "/api/chat")) and not options:
        body["options"] = {"num_predict": 2}  # absent, null or empty: the default runs long
    name = body.get("model")
    if path == "/api/pull" and isinstance(name, str) and (
            catalog.lookup(name) is not None or "://" in name):
        body["model"] = "hf.co/fuzz/repo:Q4_K_M"
    if path == "/api/delete":
        for key in ("model", "name"):
            if isinstance(body.get(key), str) and body[key].strip().lower() in STORED:
                body[key] = "fuzz-copy"
    return body


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory, smollm2_gguf):
    from conftest import import_models

    env = isolated_env(tmp_path_factory.mktemp("fuzz"), LOCALLLM_HF_ENDPOINT="http://127.0.0.1:9",
                       LOCALLLM_MAX_QUEUE="4")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    yield d
    assert d.proc.poll() is None, "the daemon died during the fuzz"
    d.stop()


def send(url: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request(method, path, body=body,
                     headers={"Content-Type": "application/json"} if body is not None else {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def check(path: str, status: int, reply: bytes) -> None:
    event(f"HTTP {status}")  # --hypothesis-show-statistics: how often each answer came
    text = reply.decode("utf-8", "replace")
    allowed = status < 500 or status in (503, 529) or (
        path == "/api/pull" and status == 502 and "cannot reach 127.0.0.1:9" in text)
    assert allowed, f"{path} answered {status}: {text[:300]}"
    assert "Traceback" not in text and "internal error" not in text, text[:300]
    if status >= 400:
        assert "error" in json.loads(text), text[:300]


SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")
FUZZ = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path", list(ROUTES))
@FUZZ
@given(data=st.data())
def test_mutated_bodies_never_make_a_5xx(fuzz_daemon, path, data):
    method, template = ROUTES[path]
    body = cheap(path, data.draw(mutated(template)))
    status, reply = send(fuzz_daemon.url, method, path, json.dumps(body).encode())
    check(path, status, reply)


@FUZZ
@given(path=st.sampled_from(list(ROUTES)), raw=st.binary(max_size=200) | st.text(max_size=80)
       .map(lambda t: t.encode("utf-8", "surrogatepass")) | st.builds(
           lambda c: json.dumps({"model": "smollm2", "prompt": "a" + c,
                                 "messages": [{"role": "user", "content": c}],
                                 "options": {"num_predict": 2}}).encode(),
           # Lone surrogates only: a high one followed by a low one is a valid pair (an
           # emoji), a request the daemon rightly answers.
           st.text(st.characters(categories=["Cs"]), min_size=1, max_size=3)
           .filter(lambda c: not SURROGATE_PAIR.search(c))))
def test_raw_bytes_and_lone_surrogates_are_4xx(fuzz_daemon, path, raw):
    status, reply = send(fuzz_daemon.url, ROUTES[path][0], path, raw)
    check(path, status, reply)
    assert 400 <= status < 500, (path, raw[:60], status, reply[:200])


@FUZZ
@given(path=st.sampled_from(GET_ROUTES) | st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7e, exclude_characters="?#%"),
    max_size=40)
    .map(lambda t: "/v1/models/" + t))
def test_get_routes_never_make_a_5xx(fuzz_daemon, path):
    status, reply = send(fuzz_daemon.url, "GET", path, None)
    check(path, status, reply)


def test_the_daemon_is_up_after_the_fuzz(fuzz_daemon):
    assert fuzz_daemon.proc.poll() is None
    assert fuzz_daemon.get("/api/version")["version"]
    names = [m["name"] for m in fuzz_daemon.get("/api/tags")["models"]]
    assert "smollm2:latest" in names
