"""Hugging Face chat templates, rendered with jinja2 in a sandboxed worker process under time,
size and memory limits (template_worker.py, template_process.py), and what a template tells
about its model: whether it takes tools, in which format its model writes tool calls, and how it
separates thinking from the answer.

Templates get the variables HF's `apply_chat_template` passes: `messages`, `tools`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`, plus the
thinking switches templates read (`enable_thinking`, `reasoning_effort`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .template_process import RenderError, render_in_worker

# Tool-call formats (how the model writes a call) and thinking formats.
HERMES, LLAMA3, MISTRAL, HARMONY, JSON_CALLS = "hermes", "llama3", "mistral", "harmony", "json"
THINK_TAGS, CHANNELS = "think_tags", "channels"


# Ollama's template for a model that brings none (template/template.go: DefaultTemplate):
# `/api/show` reports it under this name, and `render_default` renders it.
DEFAULT_TEMPLATE = "{{ .Prompt }}"


class TemplateFailed(ValueError):
    """The template raised, could not be compiled, or broke a limit (`limit`: "time", "size"
    or "memory"): a 400."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class TemplateStyle:
    tools: bool  # the template renders a `tools` list
    tool_format: str | None  # HERMES, LLAMA3, MISTRAL, HARMONY or JSON_CALLS
    thinking: str | None  # THINK_TAGS, CHANNELS or None
    stops: tuple[str, ...] = ()  # end-of-turn markers the template writes


def template_style(template: str | None, architecture: str = "") -> TemplateStyle:
    if not template:
        return TemplateStyle(tools=False, tool_format=None, thinking=None)
    harmony = "<|channel|>" in template or architecture == "gpt-oss"
    tools = "tools" in template or "tool_call" in template
    if harmony:
        tool_format = HARMONY
    elif "<tool_call>" in template:
        tool_format = HERMES
    elif "[TOOL_CALLS]" in template:
        tool_format = MISTRAL
    elif "<|python_tag|>" in template or "ipython" in template:
        tool_format = LLAMA3
    else:
        tool_format = JSON_CALLS
    if harmony:
        thinking = CHANNELS
    elif "<think>" in template and "</think>" in template:
        thinking = THINK_TAGS
    else:
        thinking = None
    stops = tuple(s for s in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|return|>",
                              "<end_of_turn>", "<|endoftext|>") if s in template)
    return TemplateStyle(tools=tools, tool_format=tool_format if tools else None,
                         thinking=thinking, stops=stops)


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None,
           bos: str = "", eos: str = "", think: bool | str | None = None,
           add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`; `think` is None (the template's default), a bool, or
    an effort level ("low", "medium", "high")."""
    variables = {
        "messages": messages,
        "tools": tools or None,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos,
        "eos_token": eos,
    }
    if think is not None:
        variables["enable_thinking"] = bool(think)
        if isinstance(think, str):
            variables["reasoning_effort"] = think
    try:
        return render_in_worker(template, variables)
    except RenderError as e:  # a template may fail on any jinja error; the client gets a 400
        raise TemplateFailed(str(e), e.limit) from None


def render_default(messages: list[dict]) -> str:
    """The prompt Ollama's default template `{{ .Prompt }}` makes of a conversation: the user
    turns' text, one after another. As Ollama's legacy path does, back-to-back messages of one
    role are first joined with a blank line, and system and assistant text is left out (the
    template names only `.Prompt`)."""
    parts: list[str] = []
    previous = None
    for message in messages:
        role = message.get("role")
        if role == "user":
            if previous == "user":
                parts.append("\n\n")
            parts.append(message.get("content") or "")
        previous = role
    return "".join(parts)
