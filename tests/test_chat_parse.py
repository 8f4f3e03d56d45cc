"""The output parsers on what each model family really writes, whole and streamed in pieces."""

from __future__ import annotations

import pytest

from localllm.daemon.chat.parse import Parsed, calls_from_json, make_parser
from localllm.daemon.chat.template import (
    HARMONY,
    HERMES,
    JSON_CALLS,
    LLAMA3,
    MISTRAL,
    THINK_TAGS,
    template_style,
)

# What the models emit after the generation prompt (special tokens rendered as text).
QWEN_TWO_CALLS = (
    'I will check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": '
    '"get_weather", "arguments": {"city": "Berlin", "unit": "celsius"}}\n</tool_call>')
LLAMA32_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA31_PYTHON_TAG = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
MISTRAL_V3 = ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]')
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
QWEN3_THINKING = ("<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is 4.")
DEEPSEEK_R1_AFTER_OPEN_THINK = "Okay, 2+2 is basic arithmetic: 4.\n</think>\n\n2 + 2 = 4."
GPT_OSS_CALL = (
    "<|channel|>analysis<|message|>User wants weather in Paris. Call get_weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris"}')
GPT_OSS_ANSWER = (
    "<|channel|>analysis<|message|>Simple greeting; answer politely.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?")


def run(parser, text: str, piece: int | None) -> Parsed:
    out = Parsed()
    if piece is None:
        out.add(parser.feed(text))
    else:
        for i in range(0, len(text), piece):
            out.add(parser.feed(text[i:i + piece]))
    out.add(parser.finish())
    return out


PIECES = [None, 1, 3, 7]


@pytest.mark.parametrize("piece", PIECES)
def test_qwen_hermes_parallel_calls_and_leading_text(piece):
    out = run(make_parser(HERMES, None, tools=True), QWEN_TWO_CALLS, piece)
    assert out.content.strip() == "I will check both cities."
    assert [(c.name, c.arguments["city"], c.index) for c in out.tool_calls] == [
        ("get_weather", "Paris", 0), ("get_weather", "Berlin", 1)]
    assert all(c.id.startswith("call_") and len(c.id) == 13 for c in out.tool_calls)
    assert len({c.id for c in out.tool_calls}) == 2


def test_hermes_calls_stream_out_as_soon_as_each_closes():
    parser = make_parser(HERMES, None, tools=True)
    first_close = QWEN_TWO_CALLS.index("</tool_call>") + len("</tool_call>")
    early = parser.feed(QWEN_TWO_CALLS[:first_close])
    assert [c.arguments["city"] for c in early.tool_calls] == ["Paris"]
    rest = parser.feed(QWEN_TWO_CALLS[first_close:])
    rest.add(parser.finish())
    assert [c.arguments["city"] for c in rest.tool_calls] == ["Berlin"]
    assert rest.tool_calls[0].index == 1


@pytest.mark.parametrize("piece", PIECES)
@pytest.mark.parametrize("text", [LLAMA32_CALL, LLAMA31_PYTHON_TAG])
def test_llama3_json_calls(text, piece):
    out = run(make_parser(LLAMA3, None, tools=True), text, piece)
    assert out.content == ""
    assert [(c.name, c.arguments) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("piece", PIECES)
def test_mistral_array_and_args_forms(piece):
    out = run(make_parser(MISTRAL, None, tools=True), MISTRAL_V3, piece)
    assert [c.name for c in out.tool_calls] == ["get_weather", "get_time"]
    assert out.tool_calls[1].arguments == {"timezone": "Europe/Paris"}
    out = run(make_parser(MISTRAL, None, tools=True), MISTRAL_V11, piece)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("piece", PIECES)
def test_think_tags_split_thinking_from_content(piece):
    out = run(make_parser(None, THINK_TAGS, tools=False), QWEN3_THINKING, piece)
    assert out.thinking.strip() == "The user asks 2+2. That is 4."
    assert out.content == "The answer is 4."


@pytest.mark.parametrize("piece", PIECES)
def test_prompt_that_opened_the_think_block(piece):
    parser = make_parser(None, THINK_TAGS, tools=False, in_thinking=True)
    out = run(parser, DEEPSEEK_R1_AFTER_OPEN_THINK, piece)
    assert out.thinking == "Okay, 2+2 is basic arithmetic: 4.\n"
    assert out.content == "2 + 2 = 4."


def test_think_false_drops_the_thinking():
    out = run(make_parser(None, THINK_TAGS, tools=False, keep_thinking=False), QWEN3_THINKING,
              None)
    assert out.thinking == "" and out.content == "The answer is 4."


@pytest.mark.parametrize("piece", PIECES)
def test_gpt_oss_channels(piece):
    out = run(make_parser(HARMONY, "channels", tools=True), GPT_OSS_CALL, piece)
    assert out.thinking == "User wants weather in Paris. Call get_weather."
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert out.content == ""
    out = run(make_parser(HARMONY, "channels", tools=False), GPT_OSS_ANSWER, piece)
    assert out.thinking == "Simple greeting; answer politely."
    assert out.content == "Hello! How can I help?"


def test_without_tools_nothing_is_a_call():
    out = run(make_parser(HERMES, None, tools=False), QWEN_TWO_CALLS, 5)
    assert out.tool_calls == [] and out.content == QWEN_TWO_CALLS
    out = run(make_parser(LLAMA3, None, tools=False), LLAMA32_CALL, 5)
    assert out.tool_calls == [] and out.content == LLAMA32_CALL


def test_broken_call_is_shown_as_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    out = run(make_parser(HERMES, None, tools=True), text, 4)
    assert out.tool_calls == [] and out.content == text
    out = run(make_parser(JSON_CALLS, None, tools=True), "{not json at all", 4)
    assert out.tool_calls == [] and out.content == "{not json at all"


def test_plain_content_around_partial_markers_is_kept():
    text = "a < b and <tool is not a tag; <think about it"
    out = run(make_parser(HERMES, THINK_TAGS, tools=True), text, 1)
    assert out.content == text and not out.thinking and not out.tool_calls


def test_string_encoded_arguments_are_read():
    assert calls_from_json('{"name": "f", "arguments": "{\\"x\\": 1}"}') == [("f", {"x": 1})]
    assert calls_from_json('{"name": "f", "arguments": 3}') is None


@pytest.mark.parametrize("template,tool_format,thinking", [
    ("{% if tools %}<tool_call>{% endif %}", HERMES, None),
    ("{{ tools }}<|python_tag|>ipython", LLAMA3, None),
    ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", MISTRAL, None),
    ("{{ tools }}<|channel|>analysis", HARMONY, "channels"),
    ("<think>{{ messages }}</think>", None, THINK_TAGS),
    ("{{ messages }}", None, None),
])
def test_template_style_detection(template, tool_format, thinking):
    style = template_style(template)
    assert style.tool_format == tool_format and style.thinking == thinking
    assert style.tools == (tool_format is not None)
