"""POST /v1/responses/input_tokens and /v1/chat/completions/input_tokens: the prompt's tokens
before it is sent, the same number the answer to the same body reports as its prompt."""

from __future__ import annotations

import httpx

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three rivers of Europe."}]


def test_chat_completions_count_is_the_answers_prompt_tokens(daemon):
    body = {"model": "smollm2", "messages": MESSAGES}
    counted = httpx.post(daemon.url + "/v1/chat/completions/input_tokens", json=body,
                         timeout=300)
    assert counted.status_code == 200, counted.text
    assert counted.json()["object"] == "response.input_tokens"
    answer = httpx.post(daemon.url + "/v1/chat/completions", timeout=300,
                        json={**body, "max_tokens": 1, "temperature": 0})
    assert counted.json()["input_tokens"] == answer.json()["usage"]["prompt_tokens"] > 10


def test_responses_count_is_the_answers_input_tokens(daemon):
    body = {"model": "smollm2", "instructions": "You are terse.",
            "input": "Name three rivers of Europe."}
    counted = httpx.post(daemon.url + "/v1/responses/input_tokens", json=body, timeout=300)
    assert counted.status_code == 200, counted.text
    answer = httpx.post(daemon.url + "/v1/responses", timeout=300,
                        json={**body, "max_output_tokens": 1, "store": False})
    assert counted.json()["input_tokens"] == answer.json()["usage"]["input_tokens"] > 10


def test_a_bad_body_is_the_routes_own_400(daemon):
    reply = httpx.post(daemon.url + "/v1/responses/input_tokens", json={"model": "smollm2"},
                       timeout=60)
    assert reply.status_code == 400 and "input" in reply.json()["error"]["message"]
    reply = httpx.post(daemon.url + "/v1/chat/completions/input_tokens",
                       json={"model": "no-such-model", "messages": MESSAGES}, timeout=60)
    assert reply.status_code == 404 and "no-such-model" in reply.text
