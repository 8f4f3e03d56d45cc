"""The Responses API's request, translated for the chat layer: `input` items into HF-shaped
messages, `tools` into function tools (custom tools as tools taking one string, a namespace's
tools flattened), `tool_choice`, `text.format` and `reasoning` (see responses.py for the route).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..chat.compaction import summary_message
from .common import bad_request
from .openai import output_format, think_from_effort

# Items of hosted tools' calls that may come back in `input`: nothing here can read them.
HOSTED_ITEMS = ("web_search_call", "file_search_call", "computer_call",
                "computer_call_output", "code_interpreter_call", "image_generation_call",
                "local_shell_call", "local_shell_call_output", "mcp_call", "mcp_list_tools",
                "mcp_approval_request", "mcp_approval_response", "item_reference")


def image_from_part(part: dict, where: str) -> str:
    """An `input_image` part as the chat layer carries images: its URL (data: or http)."""
    url = part.get("image_url")
    if isinstance(url, dict):  # the chat-completions shape, which some clients send here
        url = url.get("url")
    if not isinstance(url, str):
        raise bad_request(f"{where}.image_url must be a URL (file_id is not supported)",
                          "input")
    return url


def _content(content, where: str) -> tuple[str, list[str]]:
    """A message's or a tool output's content as (text, images)."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    texts, images = [], []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            texts.append(str(part.get("text") or ""))
        elif kind == "refusal":
            texts.append(str(part.get("refusal") or ""))
        elif kind == "input_image":
            images.append(image_from_part(part, f"{where}.content[{j}]"))
        else:
            raise bad_request(f"{where}.content[{j}]: a part of type {kind!r} is not supported "
                              f"(input_text, output_text and input_image are)", "input")
    return "\n".join(texts), images


def _call_arguments(item: dict, where: str) -> dict:
    if item["type"] == "custom_tool_call":
        return {"input": str(item.get("input") or "")}
    arguments = item.get("arguments") or "{}"
    try:
        value = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        raise bad_request(f"{where}.arguments is not valid JSON", "input") from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}.arguments must be a JSON object", "input")
    return value


def input_messages(value, earlier_calls: frozenset[str] = frozenset(),
                   tools: ToolSet | None = None) -> list[dict]:
    """`input` (a string or items) as HF-shaped messages (see common.get_messages). A call's
    output must answer a call in `input` or among `earlier_calls` (the previous response's)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise bad_request("field 'input' must be a string or a list of items", "input")
    out: list[dict] = []
    reasoning: list[str] = []  # a reasoning item belongs to the assistant turn after it

    def assistant() -> dict:
        """The assistant message a call or text joins: the last one, unless a turn passed."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        if reasoning:
            out[-1]["reasoning_content"] = out[-1]["thinking"] = "\n".join(reasoning)
            reasoning.clear()
        return out[-1]

    names: dict[str, str] = {}  # call_id -> tool name, for the outputs that follow
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant",
                                  "input")
            text, images = _content(item.get("content"), where)
            if role == "assistant":
                message = assistant()
                message["content"] += text
            else:
                message = {"role": "system" if role == "developer" else role, "content": text}
                out.append(message)
            if images:
                message["images"] = images
        elif kind in ("function_call", "custom_tool_call"):
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise bad_request(f"{where} needs a call_id and a name", "input")
            if isinstance(item.get("namespace"), str) and tools is not None:
                name = tools.offered_name(item["namespace"], name)
            names[call_id] = name
            assistant().setdefault("tool_calls", []).append({
                "type": "function", "id": call_id,
                "function": {"name": name, "arguments": _call_arguments(item, where)}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"{where} needs a call_id", "input")
            if call_id not in names and call_id not in earlier_calls:
                raise bad_request(f"{where}: no function_call with call_id {call_id!r} before "
                                  f"this output (in input or the previous response)", "input")
            text, images = _content(item.get("output"), where)
            result = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in names:
                result["name"] = names[call_id]
            if images:
                result["images"] = images
            out.append(result)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            text, _ = _content(parts, where)
            if text:
                reasoning.append(text)
        elif kind in ("compaction", "compaction_summary"):  # a summary this server wrote
            summary = item.get("encrypted_content") or item.get("summary") or ""
            out.append(summary_message(str(summary)))
        elif kind in HOSTED_ITEMS or kind == "compaction_trigger":  # (read by the route)
            continue
        else:
            raise bad_request(f"{where}: an item of type {kind!r} is not supported", "input")
    return out


CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}},
                "required": ["input"]}


@dataclass(frozen=True)
class ToolSet:
    """A request's tools as the model is offered them."""
    tools: tuple[dict, ...] = ()  # function tools in the chat layer's shape
    custom: frozenset[str] = frozenset()  # the free-form (custom) ones, by offered name
    # A namespace's tools are offered by their own name (`namespace.name` where that would
    # clash with another tool's): offered name -> (namespace, name), for the call items.
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)

    def offered_name(self, namespace: str, name: str) -> str:
        """The name a namespace's tool is offered (and its calls rendered) under."""
        return next((offered for offered, where in self.namespaced.items()
                     if where == (namespace, name)), name)


def _tool(tool: dict, where: str, name: str) -> tuple[dict, bool]:
    """(a function or custom tool in the chat layer's shape, whether it is custom)."""
    description = str(tool.get("description") or "")
    if tool.get("type") == "function":
        parameters = tool.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", "tools")
    else:
        parameters = CUSTOM_INPUT
        spec = tool.get("format")
        if isinstance(spec, dict) and spec.get("type") == "grammar":
            description += (f"\n\nThe input must follow this {spec.get('syntax', '')} "
                            f"grammar:\n{spec.get('definition', '')}")
    return {"type": "function", "function": {
        "name": name, "description": description, "parameters": parameters}}, \
        tool.get("type") == "custom"


def _named(tool: dict, where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a string", "tools")
    return name


def responses_tools(body: dict) -> ToolSet:
    """`tools`: function and custom tools as they are, a `namespace` tool's function and
    custom tools flattened (Codex sends its sub-agent tools so), and neither hosted tools nor
    `defer_loading` ones (found through a tool search this server does not run) offered."""
    tools = body.get("tools")
    if tools is None:
        return ToolSet()
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("field 'tools' must be a list of tool objects", "tools")
    offered = [(tool, f"tools[{i}]", None) for i, tool in enumerate(tools)
               if tool.get("type") in ("function", "custom")]
    for i, tool in enumerate(tools):
        if tool.get("type") != "namespace":
            continue  # (the others are hosted tools: nothing here runs them)
        namespace, inner = _named(tool, f"tools[{i}]"), tool.get("tools")
        if not isinstance(inner, list) or not all(isinstance(t, dict) for t in inner):
            raise bad_request(f"tools[{i}].tools must be a list of tool objects", "tools")
        offered += [(sub, f"tools[{i}].tools[{j}]", namespace) for j, sub in enumerate(inner)
                    if sub.get("type") in ("function", "custom")]
    offered = [o for o in offered if not o[0].get("defer_loading")]
    top = {_named(tool, where) for tool, where, namespace in offered if namespace is None}
    out, custom, namespaced = [], set(), {}
    for tool, where, namespace in offered:
        name = _named(tool, where)
        if namespace is not None:
            plain = name not in top and name not in namespaced
            name = name if plain else f"{namespace}.{name}"
            namespaced[name] = (namespace, tool["name"])
        function, is_custom = _tool(tool, where, name)
        out.append(function)
        if is_custom:
            custom.add(name)
    return ToolSet(tuple(out), frozenset(custom), namespaced)


def responses_tool_choice(body: dict) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if not isinstance(choice, dict):
        raise bad_request("tool_choice must be 'auto', 'none', 'required' or a tool object",
                          "tool_choice")
    kind = choice.get("type")
    if kind in ("function", "custom"):
        if not isinstance(choice.get("name"), str):
            raise bad_request(f"tool_choice of type {kind} needs a name", "tool_choice")
        return {"name": choice["name"]}
    if kind == "allowed_tools":
        return "required" if choice.get("mode") == "required" else "auto"
    return "auto"  # a hosted tool: the model cannot be made to call it here


def text_format(body: dict):
    """`text.format` -> the chat layer's format (None, "json" or a JSON schema)."""
    text = body.get("text")
    spec = text.get("format") if isinstance(text, dict) else None
    if spec is None:
        return None
    return output_format(spec, spec.get("schema") if isinstance(spec, dict) else None,
                         "text", "text.format.schema", "text.format")


def reasoning_effort(body: dict) -> bool | str | None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise bad_request("field 'reasoning' must be an object", "reasoning")
    return think_from_effort(reasoning.get("effort"), "reasoning.effort")
