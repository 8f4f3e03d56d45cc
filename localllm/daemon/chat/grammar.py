"""`format` and forced tool calls as GBNF grammars (root rule `root`) for llama.cpp's sampler.

JSON schema -> GBNF uses llama-cpp-python's converter (`llama_grammar.py`, pure Python). The
daemon must not load libllama, and importing `llama_cpp.llama_grammar` runs the package's
`__init__`, which does; so the converter's file is loaded on its own, by path.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from types import ModuleType

from .template import HERMES, LLAMA3, MISTRAL


class BadFormat(ValueError):
    """`format` / `response_format` / a tool's parameters are not a usable JSON schema."""


@cache
def _converter() -> ModuleType:
    spec = importlib.util.find_spec("llama_cpp")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise BadFormat("llama-cpp-python is not installed; structured output needs it")
    path = f"{spec.submodule_search_locations[0]}/llama_grammar.py"
    module_spec = importlib.util.spec_from_file_location("_localllm_llama_grammar", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # its dataclass-like helpers look themselves up
    module_spec.loader.exec_module(module)
    return module


def schema_grammar(schema: dict) -> str:
    """GBNF for JSON that validates against `schema` ($defs/$ref, anyOf, enum, required...)."""
    if not isinstance(schema, dict):
        raise BadFormat("a JSON schema must be an object")
    try:
        return _converter().json_schema_to_gbnf(json.dumps(schema))
    except BadFormat:
        raise
    except Exception as e:  # the converter raises bare errors on schemas it cannot follow
        raise BadFormat(f"cannot turn this JSON schema into a grammar: {e}") from None


def format_grammar(fmt) -> str | None:
    """Ollama's `format`: None or "" (free text), "json" (any JSON object), or a schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return schema_grammar({"type": "object"})
    if isinstance(fmt, dict):
        return schema_grammar(fmt)
    raise BadFormat(f'invalid format: {json.dumps(fmt)[:80]}; expected "json" or a valid JSON '
                    f"Schema object")


def _call_schema(tools: list[dict], args_key: str) -> dict:
    """One call to any of `tools`: {"name": <its name>, args_key: <its parameters>}."""
    options = []
    for tool in tools:
        function = tool.get("function") or {}
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({
            "type": "object",
            "properties": {"name": {"const": function.get("name", "")}, args_key: parameters},
            "required": ["name", args_key],
        })
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_call_grammar(tools: list[dict], tool_format: str | None) -> str:
    """A grammar that admits only one or more well-formed calls in the model's own format."""
    args_key = "parameters" if tool_format == LLAMA3 else "arguments"
    call = schema_grammar(_call_schema(tools, args_key))
    # Keep the converter's rules, with its root renamed so the format can wrap it.
    lines = [("localllm-call ::=" + line[len("root ::="):]) if line.startswith("root ::=")
             else line for line in call.splitlines()]
    if tool_format == HERMES:
        root = 'root ::= "<tool_call>\\n" localllm-call "\\n</tool_call>"'
    elif tool_format == MISTRAL:
        root = 'root ::= "[TOOL_CALLS][" localllm-call ("," localllm-call)* "]"'
    else:  # Llama 3.x and plain JSON: the bare object
        root = "root ::= localllm-call"
    return "\n".join([root, *lines]) + "\n"
