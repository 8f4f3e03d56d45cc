"""System messages in the middle of a conversation (Claude Code sends its environment as one,
after the user's first turn; OpenAI clients send `developer` messages anywhere): kept as a
system turn where the model's template writes one, else merged, marked, into a user turn.
The placement against real templates in the real template worker; the routes through the real
`anthropic` and `openai` clients and a curl-shaped body, against a real daemon."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from chat_models import QWEN_TOOL_TEMPLATE
from localllm.daemon.chat.roles import (
    fold_system_messages,
    marked,
    place_system_messages,
    places_mid_system,
)
from localllm.daemon.chat.template import render

# Written after Gemma's and Mistral's templates: a system message only first, then user and
# assistant alternating; anything else raises.
STRICT_TEMPLATE = """\
{%- if messages[0]['role'] == 'system' %}{%- set first = messages[0]['content'] + '\\n\\n' %}\
{%- set loop_messages = messages[1:] %}\
{%- else %}{%- set first = '' %}{%- set loop_messages = messages %}{%- endif %}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}\
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + (first if loop.first else '') \
+ message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
# Some templates take only messages[0] as the system prompt and skip any other silently.
DROPPING_TEMPLATE = """\
{%- for message in messages %}
{%- if message['role'] != 'system' or loop.first %}\
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
ENVIRONMENT = "Primary working directory: /srv/project-7q. Platform: linux."
CLAUDE_CODE_MESSAGES = [{"role": "user", "content": "List the files."},
                        {"role": "system", "content": ENVIRONMENT}]


# ---- placement -----------------------------------------------------------------------------
def test_each_template_is_asked_whether_it_places_a_later_system_message():
    assert places_mid_system(QWEN_TOOL_TEMPLATE)
    assert not places_mid_system(STRICT_TEMPLATE)  # it raises
    assert not places_mid_system(DROPPING_TEMPLATE)  # it drops the message


def test_a_template_with_system_turns_gets_the_messages_as_they_are():
    messages = [{"role": "system", "content": "Be brief."}, *CLAUDE_CODE_MESSAGES]
    assert place_system_messages(messages, QWEN_TOOL_TEMPLATE) == messages
    prompt = render(QWEN_TOOL_TEMPLATE, messages)
    assert f"<|im_start|>system\n{ENVIRONMENT}<|im_end|>" in prompt


@pytest.mark.parametrize("template", [STRICT_TEMPLATE, DROPPING_TEMPLATE])
def test_elsewhere_a_later_system_message_is_merged_marked_into_a_user_turn(template):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "system", "content": "The user is on a train."},
        {"role": "user", "content": "Where am I?"},
        {"role": "system", "content": ENVIRONMENT}]
    placed = place_system_messages(messages, template)
    assert [m["role"] for m in placed] == ["system", "user", "assistant", "user"]
    assert placed[3]["content"] == (f"{marked('The user is on a train.')}\n\nWhere am I?"
                                    f"\n\n{marked(ENVIRONMENT)}")
    prompt = render(template, placed)  # the strict template renders it without raising
    assert "The user is on a train." in prompt and ENVIRONMENT in prompt


def test_folding_joins_the_leading_system_messages_and_gives_a_lone_one_a_user_turn():
    assert fold_system_messages([{"role": "system", "content": "A"},
                                 {"role": "system", "content": "B"},
                                 {"role": "user", "content": "q"}]) == [
        {"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "q"}]
    after_a_call = [{"role": "user", "content": "q"},
                    {"role": "assistant", "content": "", "tool_calls": []},
                    {"role": "tool", "content": "42"},
                    {"role": "system", "content": "Note"}]
    assert fold_system_messages(after_a_call)[-1] == {"role": "user",
                                                      "content": marked("Note")}


# ---- the routes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def strict_model(agent_daemon):
    """smollm2 with a template that takes a system message only first (made by /api/create)."""
    reply = httpx.post(f"{agent_daemon.url}/api/create", timeout=120, json={
        "model": "smollm2-strict", "from": "smollm2", "template": STRICT_TEMPLATE,
        "stream": False})
    assert reply.status_code == 200, reply.text
    return "smollm2-strict"


@pytest.fixture(scope="module")
def claude(agent_daemon):
    return anthropic.Anthropic(base_url=agent_daemon.url, api_key="unused", max_retries=0)


@pytest.mark.parametrize("model", ["smollm2-tools", "smollm2-strict"])
def test_claude_codes_mid_conversation_system_message_is_answered_and_read(
        claude, strict_model, model):
    answer = claude.messages.create(model=model, max_tokens=3, messages=CLAUDE_CODE_MESSAGES,
                                    system="You are a coding agent.")
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn",
                                                                       "max_tokens")
    # The system message is in the prompt: the count grows by about its own tokens.
    with_it = claude.messages.count_tokens(model=model, messages=CLAUDE_CODE_MESSAGES)
    without = claude.messages.count_tokens(model=model, messages=CLAUDE_CODE_MESSAGES[:1])
    assert with_it.input_tokens - without.input_tokens >= 15


def test_the_curl_shape_of_the_report_is_answered(agent_daemon):
    """The body as a curl -d sends it, blocks and all, with a system entry in `messages`."""
    body = ('{"model": "smollm2-tools", "max_tokens": 4, "stream": false, "messages": ['
            '{"role": "user", "content": [{"type": "text", "text": "say hi"}]}, '
            '{"role": "system", "content": [{"type": "text", "text": "# Environment\\n'
            'Platform: linux", "cache_control": {"type": "ephemeral"}}]}]}')
    reply = httpx.post(f"{agent_daemon.url}/v1/messages?beta=true", content=body,
                       timeout=120, headers={"content-type": "application/json",
                                             "anthropic-version": "2023-06-01"})
    assert reply.status_code == 200, reply.text
    assert reply.json()["content"][0]["type"] == "text"
    bad = httpx.post(f"{agent_daemon.url}/v1/messages", timeout=120, json={
        "model": "smollm2-tools", "max_tokens": 4,
        "messages": [{"role": "narrator", "content": "hi"}]})
    assert bad.status_code == 400
    assert "'user', 'assistant' or 'system'" in bad.json()["error"]["message"]


def test_openai_developer_and_system_messages_mid_conversation(agent_daemon, strict_model):
    client = openai.OpenAI(base_url=agent_daemon.url + "/v1", api_key="unused", max_retries=0)
    for role in ("system", "developer"):
        answer = client.chat.completions.create(model=strict_model, max_tokens=3, messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi."},
            {"role": role, "content": ENVIRONMENT},
            {"role": "user", "content": "Where am I?"}])
        assert answer.choices[0].message.content is not None
