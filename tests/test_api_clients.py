"""The official `ollama` and `openai` clients against a real daemon and real llama.cpp."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import ollama
import openai
import pytest
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter

QUICK = {"num_predict": 24, "temperature": 0}


@pytest.fixture(scope="module")
def oc(daemon):
    return ollama.Client(host=daemon.url)


@pytest.fixture(scope="module")
def ai(daemon):
    return openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")


def test_ollama_chat_not_streamed(oc):
    r = oc.chat(model="smollm2", messages=[{"role": "user", "content": "Say hello."}],
                options=QUICK)
    assert r.message.role == "assistant" and r.message.content.strip()
    assert r.done and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.eval_duration > 0 and r.prompt_eval_duration > 0 and r.total_duration > 0


def test_ollama_chat_streamed(oc):
    parts = list(oc.chat(model="smollm2", messages=[{"role": "user", "content": "Count to 5."}],
                         stream=True, options=QUICK))
    assert len(parts) > 2
    assert not any(p.done for p in parts[:-1]) and parts[-1].done
    text = "".join(p.message.content for p in parts)
    assert text.strip()
    final = parts[-1]
    assert final.eval_count > 0 and final.eval_duration > 0 and final.prompt_eval_count > 0


def test_second_turn_evaluates_only_the_new_tokens(oc, daemon, smollm2_gguf):
    first_messages = [{"role": "user", "content": "Name a colour."}]
    first = oc.chat(model="smollm2", messages=first_messages, options={**QUICK, "seed": 1})
    second_messages = first_messages + [
        {"role": "assistant", "content": first.message.content},
        {"role": "user", "content": "Name another one."},
    ]
    second = oc.chat(model="smollm2", messages=second_messages, options={**QUICK, "seed": 1})
    assert second.message.content.strip()
    # An independent count: the same template and tokenizer, outside the daemon.
    vocab = Llama(str(smollm2_gguf), vocab_only=True, verbose=False)
    template = vocab.metadata["tokenizer.chat_template"]
    fmt = Jinja2ChatFormatter(template=template, eos_token="<|im_end|>",
                              bos_token="<|im_start|>")

    def count(messages):
        return len(vocab.tokenize(fmt(messages=messages).prompt.encode(), add_bos=False,
                                  special=True))

    # prompt_eval_count is the whole input, as Ollama counts it (the cached part too)
    assert first.prompt_eval_count == count(first_messages)
    # An answer cut by num_predict ends with a token that was sampled but never fed back to the
    # model, so the next turn reads it with its own new tokens.
    in_cache = first.eval_count - (1 if first.done_reason == "length" else 0)
    new_tokens = count(second_messages) - (count(first_messages) + in_cache)
    assert second.prompt_eval_count == count(second_messages)
    # What the runner read: only the new tokens (the daemon's record of the last request).
    last = next(m for m in daemon.get("/api/stats")["models"]
                if m["model"] == "smollm2:latest")["last"]
    assert last["prompt_eval_count"] == new_tokens < count(second_messages) / 2
    assert last["cached_tokens"] == count(second_messages) - new_tokens


def test_ollama_generate_with_gemma_which_has_no_template(oc):
    r = oc.generate(model="gemma3-270m", prompt="The capital of France is", options=QUICK)
    assert r.response.strip() and r.eval_count > 0 and r.context


def test_stop_strings_end_the_answer_before_the_stop(oc):
    r = oc.generate(model="gemma3-270m", prompt="1, 2, 3, 4, 5,", raw=True,
                    options={"num_predict": 30, "temperature": 0, "stop": ["8"]})
    assert "8" not in r.response and r.done_reason == "stop"
    assert "7" in r.response


def test_seed_makes_sampling_repeatable(oc):
    opts = {"num_predict": 16, "temperature": 1.0, "seed": 42}
    # The first call leaves the prompt cached; the next two then run the very same computation
    # (a cached prefix is evaluated in other batches, which may move near-tied logits).
    oc.generate(model="gemma3-270m", prompt="Once upon a time", options=opts)
    a = oc.generate(model="gemma3-270m", prompt="Once upon a time", options=opts)
    b = oc.generate(model="gemma3-270m", prompt="Once upon a time", options=opts)
    assert a.response == b.response and a.eval_count == 16


def test_openai_chat_not_streamed(ai):
    r = ai.chat.completions.create(model="smollm2", max_tokens=24, temperature=0,
                                   messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_openai_chat_streamed_with_usage(ai):
    chunks = list(ai.chat.completions.create(
        model="smollm2", max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say hello."}]))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].usage.prompt_tokens > 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])


def test_openai_completions_with_gemma(ai):
    r = ai.completions.create(model="gemma3-270m", prompt="1, 2, 3,", max_tokens=8,
                              temperature=0)
    assert r.choices[0].text.strip() and r.usage.completion_tokens > 0
    chunks = list(ai.completions.create(model="gemma3-270m", prompt="1, 2, 3,", max_tokens=8,
                                        temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text


def test_sse_stream_ends_with_done(daemon):
    body = json.dumps({"model": "smollm2", "max_tokens": 4, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    req = urllib.request.Request(daemon.url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in resp.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_model_listing_routes(oc, ai, daemon):
    names = {m.model for m in oc.list().models}
    assert {"smollm2:latest", "gemma3-270m:latest"} <= names
    assert {m.id for m in ai.models.list()} >= {"smollm2:latest", "gemma3-270m:latest"}
    show = oc.show("smollm2")
    assert show.modelinfo["general.architecture"] == "llama"
    assert show.modelinfo["llama.block_count"] == 30
    assert "<|im_start|>" in show.template
    assert daemon.get("/api/version")["version"]
    oc.generate(model="smollm2", prompt="hi", options={"num_predict": 2})
    loaded = {m.model: m for m in oc.ps().models}
    assert loaded["smollm2:latest"].context_length == 4096
    assert loaded["smollm2:latest"].size > 98_000_000 and loaded["smollm2:latest"].size_vram == 0
    assert loaded["smollm2:latest"].expires_at is not None


def post(daemon, path: str, data: bytes, method: str = "POST"):
    req = urllib.request.Request(daemon.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/api/chat", b"{not json", 400, "invalid JSON"),
    ("/api/chat", b"[1, 2]", 400, "JSON object"),
    ("/api/chat", b'{"model": 5, "messages": []}', 400, "'model' must be a string"),
    ("/api/chat", b'{"model": "smollm2", "messages": "hi"}', 400, "messages"),
    ("/api/chat", b'{"model": "smollm2", "messages": [{"role": "x", "content": "a"}]}', 400,
     "role"),
    ("/api/generate", b'{"model": "smollm2", "prompt": "a", "options": {"temperature": "hot"}}',
     400, "temperature"),
    ("/api/generate", b'{"model": "smollm2", "prompt": "a", "options": {"num_ctx": 1.5}}', 400,
     "num_ctx"),
    ("/api/generate", b'{"model": "smollm2", "prompt": "a", "stream": "yes"}', 400, "stream"),
    ("/api/generate", b'{"model": "smollm2", "prompt": "a", "keep_alive": "soon"}', 400,
     "duration"),
    ("/api/chat", b'{"model": "no-such-model", "messages": [{"role": "user", "content": "a"}]}',
     404, "not found"),
    ("/api/show", b'{"model": "../../etc/passwd"}', 400, "invalid model name"),
    ("/api/copy", b'{"source": "no-such-model", "destination": "x"}', 404, "not found"),
])
def test_bad_requests_get_clear_ollama_errors(daemon, path, body, status, fragment):
    code, data = post(daemon, path, body)
    assert code == status
    assert fragment in data["error"]


@pytest.mark.parametrize("body,status,fragment", [
    (b"{oops", 400, "invalid JSON"),
    (b'{"model": "smollm2", "messages": [], "max_tokens": "ten"}', 400, "max_tokens"),
    (b'{"model": "smollm2", "messages": [], "temperature": 101}', 400, "temperature"),
    (b'{"model": "ghost", "messages": [{"role": "user", "content": "a"}]}', 404, "not found"),
])
def test_bad_requests_get_openai_shaped_errors(daemon, body, status, fragment):
    code, data = post(daemon, "/v1/chat/completions", body)
    assert code == status
    assert fragment in data["error"]["message"] and data["error"]["type"]


def test_openai_client_raises_on_unknown_model(ai):
    with pytest.raises(openai.NotFoundError):
        ai.chat.completions.create(model="ghost", messages=[{"role": "user", "content": "a"}])


def test_prompt_longer_than_the_context_is_cut_as_ollama_or_a_400_without_truncate(daemon):
    code, data = post(daemon, "/api/generate", json.dumps({
        "model": "gemma3-270m", "prompt": "word " * 400, "stream": False, "truncate": False,
        "options": {"num_ctx": 256}}).encode())
    assert code == 400 and "context" in data["error"]
    code, data = post(daemon, "/api/generate", json.dumps({
        "model": "gemma3-270m", "prompt": "word " * 400, "stream": False,
        "options": {"num_ctx": 256, "num_predict": 4}}).encode())
    assert code == 200 and data["prompt_truncated_count"] > 0


def test_import_route_stores_a_gguf_and_refuses_junk(daemon, smollm2_gguf, tmp_path):
    code, data = post(daemon, "/api/import", json.dumps(
        {"model": "imported:v1", "path": str(smollm2_gguf)}).encode())
    assert code == 200 and data["name"] == "imported:v1"
    assert data["details"]["family"] == "llama"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"nope" * 10)
    code, data = post(daemon, "/api/import", json.dumps(
        {"model": "junk", "path": str(junk)}).encode())
    assert code == 400 and "not a GGUF" in data["error"]
    names = [m["name"] for m in daemon.get("/api/tags")["models"]]
    assert "imported:v1" in names and "junk:latest" not in names
    code, _ = post(daemon, "/api/delete", b'{"model": "imported:v1"}', method="DELETE")
    assert code == 200
