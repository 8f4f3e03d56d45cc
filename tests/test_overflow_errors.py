"""A prompt longer than the loaded context, answered in the words each agent's overflow
classifier reads (Claude Code and opencode compact the conversation and retry only then):
Anthropic's `invalid_request_error` "prompt is too long: N tokens > M maximum", OpenAI's
`context_length_exceeded` code with "maximum context length is M tokens", each followed by
what to do. The three ways a prompt is found too long are covered: the chat layer's count
(system prompt, tools and last message alone), the runner's count (a plain prompt), and a
prompt refused by its bytes before it is read. Real daemon, real llama.cpp, the real
`anthropic` and `openai` clients."""

from __future__ import annotations

import re

import anthropic
import httpx
import openai
import pytest

N_CTX = 512
FILLER = " ".join(f"Note {i}: the numbers below are counted one by one." for i in range(44))
SMALL = {"num_ctx": N_CTX, "temperature": 0}
ANTHROPIC_WORDING = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum\. ")
OPENAI_WORDING = re.compile(r"^This model's maximum context length is (\d+) tokens\. However, "
                            r"your messages resulted in (\d+) tokens\. ")


@pytest.fixture(scope="module")
def claude(agent_daemon):
    return anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ai(agent_daemon):
    return openai.OpenAI(base_url=agent_daemon.url + "/v1", api_key="unused", max_retries=0)


def _anthropic_sizes(error: dict) -> tuple[int, int]:
    assert error["type"] == "invalid_request_error"
    found = ANTHROPIC_WORDING.match(error["message"])
    assert found, error["message"]
    return int(found[1]), int(found[2])


def _openai_sizes(error: dict) -> tuple[int, int]:
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
    found = OPENAI_WORDING.match(error["message"])
    assert found, error["message"]
    return int(found[2]), int(found[1])


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_overflow_reads_prompt_is_too_long_with_both_sizes(claude, stream):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smollm2", max_tokens=1000, system=FILLER, stream=stream,
                               messages=[{"role": "user", "content": "Count to ten."}],
                               extra_body=SMALL)
    tokens, maximum = _anthropic_sizes(e.value.body["error"])
    assert maximum == N_CTX and tokens > N_CTX
    message = e.value.body["error"]["message"]
    # Today's advice follows, with the same count.
    assert f"alone are {tokens} tokens but the loaded context holds {N_CTX}" in message
    assert "compact it or start a new one" in message


def test_claude_codes_beta_query_gets_the_same_overflow(agent_daemon):
    r = httpx.post(f"{agent_daemon.url}/v1/messages?beta=true", timeout=120, json={
        "model": "smollm2", "max_tokens": 100, "system": FILLER, **SMALL,
        "messages": [{"role": "user", "content": "Count to ten."}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert _anthropic_sizes(r.json()["error"])[1] == N_CTX
    assert httpx.head(agent_daemon.url + "/", timeout=30).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_overflow_has_the_context_length_exceeded_code(ai, stream):
    with pytest.raises(openai.BadRequestError) as e:
        ai.chat.completions.create(model="smollm2", max_tokens=100, stream=stream,
                                   extra_body=SMALL,
                                   messages=[{"role": "system", "content": FILLER},
                                             {"role": "user", "content": "Count to ten."}])
    assert e.value.code == "context_length_exceeded"
    tokens, maximum = _openai_sizes(e.value.body)
    assert maximum == N_CTX and tokens > N_CTX
    assert "loaded context holds 512; shorten the conversation" in e.value.body["message"]


def test_responses_overflow_without_truncation_has_the_code(ai):
    with pytest.raises(openai.BadRequestError) as e:
        ai.responses.create(model="smollm2", max_output_tokens=100, instructions=FILLER,
                            input="Count to ten.", truncation="disabled", extra_body=SMALL)
    tokens, maximum = _openai_sizes(e.value.body)
    assert maximum == N_CTX and tokens > N_CTX


def test_a_plain_prompt_the_runner_counts_too_long_has_the_code(ai):
    # Completions are not cut: the runner counts the prompt and refuses it.
    with pytest.raises(openai.BadRequestError) as e:
        ai.completions.create(model="smollm2", prompt=FILLER, max_tokens=8, extra_body=SMALL)
    tokens, maximum = _openai_sizes(e.value.body)
    assert maximum == N_CTX and tokens > N_CTX
    assert f"The prompt is {tokens} tokens but the loaded context holds" in e.value.body["message"]


def test_a_prompt_refused_by_its_bytes_has_the_code_and_a_lower_bound(ai):
    huge = "x " * (N_CTX * 32)  # more bytes than any context of N_CTX tokens holds
    with pytest.raises(openai.BadRequestError) as e:
        ai.completions.create(model="smollm2", prompt=huge, max_tokens=8, extra_body=SMALL)
    tokens, maximum = _openai_sizes(e.value.body)
    assert maximum == N_CTX and tokens >= len(huge) // 32
    assert f"The prompt is {len(huge)} bytes" in e.value.body["message"]
