"""Over-long prompts as Ollama answers them: `truncate` (default true) on /api/generate and
/api/chat keeps the newest part (the oldest turns dropped, then the oldest tokens) and says how
many tokens it left out; `truncate: false` is the 400; the OpenAI routes keep refusing."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

CTX = 1024
LONG = " ".join(f"item{i} of the list" for i in range(600))  # about 2,400 tokens


def _post(daemon, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


OPTIONS = {"num_predict": 4, "temperature": 0, "num_ctx": CTX}


def test_generate_truncates_the_oldest_tokens_and_says_how_many(fresh_daemon):
    daemon = fresh_daemon  # its own: the shared one must keep smollm2 at the default context
    status, done = _post(daemon, "/api/generate", {
        "model": "smollm2", "prompt": LONG + "\nWhich item came last?", "raw": True,
        "stream": False, "options": OPTIONS})
    assert status == 200, done
    assert done["prompt_truncated_count"] > 1000
    assert CTX // 2 < done["prompt_eval_count"] <= CTX - 64  # room left for the answer
    assert len(done["context"]) == done["prompt_eval_count"] + done["eval_count"]
    status, body = _post(daemon, "/api/generate", {
        "model": "smollm2", "prompt": LONG, "raw": True, "stream": False, "truncate": False,
        "options": OPTIONS})
    assert status == 400 and "loaded context holds" in body["error"]
    status, body = _post(daemon, "/api/generate", {
        "model": "smollm2", "prompt": "Hi", "stream": False, "shift": "no",
        "options": OPTIONS})
    assert status == 400 and "shift" in body["error"]


def test_chat_keeps_the_newest_part_of_a_message_longer_than_the_context(fresh_daemon):
    daemon = fresh_daemon
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "An old question."},
                {"role": "assistant", "content": "An old answer."},
                {"role": "user", "content": LONG + "\nWhich item came last?"}]
    status, done = _post(daemon, "/api/chat", {"model": "smollm2", "messages": messages,
                                                "stream": False, "shift": False,
                                                "options": OPTIONS})
    assert status == 200, done
    assert done["dropped_messages"] == 2 and done["prompt_truncated_count"] > 1000
    assert done["message"]["content"]
    status, body = _post(daemon, "/api/chat", {"model": "smollm2", "messages": messages,
                                                "stream": False, "truncate": False,
                                                "options": OPTIONS})
    assert status == 400
    status, body = _post(daemon, "/v1/chat/completions", {
        "model": "smollm2", "messages": messages[-1:], "max_tokens": 4,
        "extra_body": {}, "num_ctx": CTX})
    assert status == 400 or "prompt_truncated_count" not in body
