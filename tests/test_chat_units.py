"""Chat-layer pieces that need no model: grammars, templates, turn dropping, Modelfiles."""

from __future__ import annotations

import subprocess
import sys

import pytest

from localllm.modelstore.modelfile import parse_modelfile
from localllm.modelstore.custom import ModelfileError
from localllm.daemon.chat.grammar import BadFormat, format_grammar, tool_call_grammar
from localllm.daemon.chat.template import TemplateFailed, render
from localllm.daemon.chat.truncate import drop_oldest_turn


def test_schema_to_grammar_does_not_load_llama_cpp_in_the_daemon():
    code = ("import sys\n"
            "from localllm.daemon.chat.grammar import format_grammar\n"
            "g = format_grammar({'type': 'object', 'properties': {'a': {'$ref': '#/$defs/A'}},"
            " '$defs': {'A': {'enum': ['x', 'y']}}, 'required': ['a']})\n"
            "assert g.startswith('A ::=') or 'root ::=' in g, g\n"
            "print('llama_cpp' in sys.modules, 'llama_cpp.llama_cpp' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False False"


def test_format_values():
    assert format_grammar(None) is None and format_grammar("") is None
    assert "root ::=" in format_grammar("json")
    with pytest.raises(BadFormat, match="invalid format"):
        format_grammar("yaml")
    with pytest.raises(BadFormat):
        format_grammar({"$ref": "#/$defs/missing"})


def test_tool_grammar_wraps_the_call_in_the_models_format():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
    hermes = tool_call_grammar(tools, "hermes")
    assert hermes.startswith('root ::= "<tool_call>\\n" localllm-call "\\n</tool_call>"')
    assert hermes.count("root ::=") == 1 and "localllm-call ::=" in hermes
    assert "parameters-kv" in tool_call_grammar(tools, "llama3")
    assert tool_call_grammar(tools, "mistral").startswith('root ::= "[TOOL_CALLS]["')


def test_template_rendering_with_hf_helpers():
    template = ("{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content }}\n"
                "{% endfor %}{% if tools %}{{ tools | tojson }}{% endif %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    text = render(template, [{"role": "user", "content": "<b>"}], bos="<s>",
                  tools=[{"name": "f"}])
    assert text == '<s>user:<b>\n[{"name": "f"}]assistant:'
    with pytest.raises(TemplateFailed, match="only user"):
        render("{{ raise_exception('only user turns') }}", [])
    assert render("{{ strftime_now('%Y') }}", [])[:2] == "20"


def test_drop_oldest_turn_keeps_system_and_last():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t1"},
            {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "u3"}]
    once = drop_oldest_turn(msgs)  # a whole turn: the question, its calls and their results
    assert [m["content"] for m in once] == ["s", "u2", "a2", "u3"]
    twice = drop_oldest_turn(once)
    assert [m["content"] for m in twice] == ["s", "u3"]
    assert drop_oldest_turn(twice) is None


def test_modelfile_subset():
    recipe = parse_modelfile('# comment\nFROM smollm2\nPARAMETER num_ctx 2048\n'
                             'PARAMETER stop "<|im_end|>"\nPARAMETER stop END\n'
                             'SYSTEM """line one\nline two"""\nTEMPLATE "{{ messages }}"\n')
    assert recipe.base == "smollm2"
    assert recipe.parameters == {"num_ctx": 2048, "stop": ["<|im_end|>", "END"]}
    assert recipe.system == "line one\nline two" and recipe.template == "{{ messages }}"
    with pytest.raises(ModelfileError, match="never closes"):
        parse_modelfile('FROM x\nSYSTEM """open')
    assert parse_modelfile("FROM x\nMESSAGE user hi").messages == [{"role": "user",
                                                                     "content": "hi"}]
    with pytest.raises(ModelfileError, match="MESSAGE takes a role"):
        parse_modelfile("FROM x\nMESSAGE robot hi")
    with pytest.raises(ModelfileError, match="QUANTIZE is not supported"):
        parse_modelfile("FROM x\nQUANTIZE q4")
