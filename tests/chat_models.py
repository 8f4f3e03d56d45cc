"""Test models for the chat layer: copies of the real SmolLM2 GGUF whose metadata gives them a
Qwen2.5-style tool template (plus FIM token ids), or a Qwen3-style thinking template."""

from __future__ import annotations

from pathlib import Path

from tests.gguf_edit import with_metadata

# Written after Qwen2.5's template: tools listed in the system turn, calls in <tool_call> tags,
# tool results folded into a user turn in <tool_response> tags.
QWEN_TOOL_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}\
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}\
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\
{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if (message.role == "user") or (message.role == "system" and not loop.first) \
or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>' + message.role }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}\
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\
{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Written after Qwen3's: the generation prompt opens a <think> block unless thinking is off,
# in which case it writes an empty one.
THINKING_TEMPLATE = """\
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}\
{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

# SmolLM2's vocabulary has no FIM tokens; three of its special tokens stand in for them, so the
# prompt a FIM request renders can be counted and checked.
FIM_IDS = {"tokenizer.ggml.fim_pre_token_id": 3, "tokenizer.ggml.fim_suf_token_id": 4,
           "tokenizer.ggml.fim_mid_token_id": 5}
FIM_PIECES = ("<repo_name>", "<reponame>", "<file_sep>")


def tool_model(smollm2: Path, directory: Path) -> Path:
    return with_metadata(smollm2, directory / "smollm2-tools.gguf",
                         {"tokenizer.chat_template": QWEN_TOOL_TEMPLATE, **FIM_IDS})


def thinking_model(smollm2: Path, directory: Path) -> Path:
    return with_metadata(smollm2, directory / "smollm2-thinking.gguf",
                         {"tokenizer.chat_template": THINKING_TEMPLATE})

# The call to the shell tool the agent offers (Claude Code's `Bash`, Codex's `exec_command`), in
# ns.call, for the templates below; ns.results counts the tool results they find.
SHELL_CALL = """\
{%- set ns = namespace(call='', results=0) %}
{%- for t in tools or [] %}{%- set f = t.function if t.function is defined else t %}
{%- if not ns.call and f.name == 'Bash' %}\
{%- set ns.call = '{"name": "Bash", "arguments": {"command": "echo localllm-tool-ok"}}' %}
{%- elif not ns.call and f.name == 'exec_command' %}\
{%- set ns.call = '{"name": "exec_command", "arguments": {"cmd": "echo localllm-tool-ok"}}' %}
{%- endif %}{%- endfor %}
"""

# The end of the templates below: four turns of the one fixed answer `want`, then the
# question; greedy decoding repeats it.
REPEAT_WANT = """\
{{- '<|im_start|>system\\nRepeat the answer.<|im_end|>\\n' }}
{%- for i in range(4) %}\
{{- '<|im_start|>user\\nGo.<|im_end|>\\n<|im_start|>assistant\\n' + want + '<|im_end|>\\n' }}\
{%- endfor %}
{{- '<|im_start|>user\\nGo.<|im_end|>\\n' }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# For the agent CLIs' end-to-end tests (tests/test_agent_clis.py): a template that makes even a
# 135M model call the agent's shell tool once, then answer. Whatever the conversation, it shows
# the model four turns of one fixed answer, then the question: greedy decoding repeats it. The
# answer is a call to the shell tool the agent offers (Claude Code's `Bash`, Codex's
# `exec_command`) until a tool result is in the conversation, then a line of text.
AGENT_TEMPLATE = SHELL_CALL + """\
{%- for m in messages %}{%- if m.role == 'tool' %}{%- set ns.results = ns.results + 1 %}\
{%- endif %}{%- endfor %}
{%- if ns.call and not ns.results %}{%- set want = '<tool_call>\\n' + ns.call + '\\n</tool_call>' %}
{%- else %}{%- set want = 'Done: the tool ran.' %}{%- endif %}
""" + REPEAT_WANT

# For Claude Code's tool search through `launch` (tests/test_agent_clis.py): as AGENT_TEMPLATE,
# four turns of one fixed answer: a call to Claude Code's ToolSearch until a search result is
# in the conversation, then a call to the MCP tool it found (tests/mcp_tools_server.py), then
# a line of text. Nothing else is rendered: a long prompt takes minutes to read on a busy CPU.
WEATHER_TOOL = "mcp__work__get_weather"
TOOL_SEARCH_TEMPLATE = ("""\
{%- set ns = namespace(search=false, found=false, called=false) %}
{%- for t in tools or [] %}{%- set f = t.function if t.function is defined else t %}\
{%- if f.name == 'ToolSearch' %}{%- set ns.search = true %}{%- endif %}{%- endfor %}
{%- for m in messages %}{%- if m.role == 'tool' and '"WEATHER"' in m.content %}\
{%- set ns.found = true %}{%- endif %}
{%- for c in m.tool_calls or [] %}{%- if c.function.name == 'WEATHER' %}\
{%- set ns.called = true %}{%- endif %}{%- endfor %}{%- endfor %}
{%- if ns.search and not ns.found %}{%- set want = '<tool_call>\\n{"name": "ToolSearch", ' + \
'"arguments": {"query": "weather"}}\\n</tool_call>' %}
{%- elif ns.found and not ns.called %}{%- set want = '<tool_call>\\n{"name": "WEATHER", ' + \
'"arguments": {"city": "Paris"}}\\n</tool_call>' %}
{%- else %}{%- set want = 'Done: the tool ran.' %}{%- endif %}
""" + REPEAT_WANT).replace("WEATHER", WEATHER_TOOL)

# For Claude Code's compaction through `launch` (tests/test_agent_clis.py): the conversation but
# its system turns rendered (a prompt cache holds it; Claude Code's system prompt would take
# minutes to read on a busy CPU), then as AGENT_TEMPLATE: a call to Bash until a
# tool result is in the conversation, then a line of text; asked for a summary (Claude Code's
# compacting turn asks for one in <summary> tags), a summary.
COMPACT_TEMPLATE = SHELL_CALL + """\
{%- for m in messages %}{%- if m.role == 'tool' %}{%- set ns.results = ns.results + 1 %}\
{%- endif %}{%- if m.role != 'system' %}{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') }}
{%- for c in m.tool_calls or [] %}{{- '<tool_call>' + (c.function.arguments | tojson) }}\
{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}
{%- if messages[-1].role == 'user' and ('<summary>' in messages[-1].content or \
'CONTEXT CHECKPOINT COMPACTION' in messages[-1].content) %}\
{%- set want = '<summary>The check ran: it printed localllm-tool-ok.</summary>' %}
{%- elif ns.call and not ns.results %}\
{%- set want = '<tool_call>\\n' + ns.call + '\\n</tool_call>' %}
{%- else %}{%- set want = 'Done: the tool ran.' %}{%- endif %}
{%- for i in range(4) %}\
{{- '<|im_start|>user\\nGo.<|im_end|>\\n<|im_start|>assistant\\n' + want + '<|im_end|>\\n' }}\
{%- endfor %}
{{- '<|im_start|>user\\nGo.<|im_end|>\\n' }}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
