"""A coding-agent session replayed against a daemon, shaped like a Claude Code session: a long
system prompt with 15 tools, turns that each add a tool call and its result, and between turns
a side request with another prompt (a title request), as agents send.

The session is written once in neutral terms (`Session`); a `Protocol` sends one request of it
over one wire format and returns the usage it reports. `openai_chat` is the OpenAI chat
completions one; another API (Anthropic Messages, OpenAI Responses) is another `Protocol`.

    usages = replay(openai_chat(client, "smollm2-tools"), Session())
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

TOOL_NAMES = ("Bash", "Read", "Edit", "Write", "Glob", "Grep", "LS", "WebFetch", "TodoWrite",
              "NotebookEdit", "Task", "MultiEdit", "ExitPlanMode", "BashOutput", "KillShell")
TOPICS = ("reading files before editing them", "running the tests after each change",
          "keeping answers short", "quoting paths exactly", "never guessing an API",
          "asking before deleting anything", "following the project's style",
          "explaining a failure in one line")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON schema of the arguments


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict


@dataclass(frozen=True)
class Message:
    """One turn of the history: a user's text, the assistant's text and tool call, or a tool's
    result (`call` says which call it answers)."""
    role: str  # "user", "assistant" or "tool"
    text: str
    call: ToolCall | None = None


@dataclass(frozen=True)
class Request:
    system: str
    tools: tuple[Tool, ...]
    messages: tuple[Message, ...]
    max_tokens: int


@dataclass(frozen=True)
class Answer:
    text: str
    prompt_tokens: int  # the whole prompt
    cached_tokens: int  # of which reused from the cache


Protocol = Callable[[Request], Answer]


def system_prompt(words: int = 1900) -> str:
    """About `words` words of agent instructions (about 2,500 tokens), every line distinct."""
    lines, n, i = ["You are a coding agent working in the user's repository."], 0, 0
    while n < words:
        topic = TOPICS[i % len(TOPICS)]
        line = (f"Rule {i + 1}: when the task touches part {i // len(TOPICS) + 1} of the work, "
                f"remember {topic}; it matters because rule {i + 1} keeps the session safe.")
        lines.append(line)
        n += len(line.split())
        i += 1
    return "\n".join(lines)


def tools() -> tuple[Tool, ...]:
    return tuple(Tool(
        name, f"{name}: a tool of the agent. Use it for {TOPICS[i % len(TOPICS)]}.",
        {"type": "object", "properties": {
            "path": {"type": "string", "description": "file or directory to act on"},
            "pattern": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "description": "how many results at most"}},
         "required": ["path"]}) for i, name in enumerate(TOOL_NAMES))


def tool_result(turn: int) -> str:
    """What a tool gave back: a file listing of about 150 tokens."""
    return "\n".join(f"src/module_{turn}_{k}.py: {10 * k + turn} lines, last changed by task "
                     f"{turn}" for k in range(8))


@dataclass
class Session:
    turns: int = 6
    answer_tokens: int = 12
    system: str = field(default_factory=system_prompt)
    tools: tuple[Tool, ...] = field(default_factory=tools)
    first_message: str = "Find where the configuration is parsed and add a setting for it."

    def title_request(self) -> Request:
        return Request(system="Write a title of at most six words for this conversation.",
                       tools=(), messages=(Message("user", self.first_message),), max_tokens=8)


def replay(send: Protocol, session: Session, side_requests: bool = True) -> list[Answer]:
    """Each main turn's answer, in order. Between turns (after the first) a side request with a
    prompt of its own goes out, as Claude Code's title and summary requests do. The assistant's
    own text goes back into the history with the tool call the agent made, then its result."""
    history: list[Message] = [Message("user", session.first_message)]
    answers = []
    for turn in range(session.turns):
        answer = send(Request(session.system, session.tools, tuple(history),
                              session.answer_tokens))
        answers.append(answer)
        if side_requests:
            send(session.title_request())
        call = ToolCall(f"call_{turn}", TOOL_NAMES[turn % len(TOOL_NAMES)],
                        {"path": f"src/module_{turn}", "limit": 8})
        history += [Message("assistant", answer.text, call),
                    Message("tool", tool_result(turn), call)]
    return answers


# ---- OpenAI chat completions -------------------------------------------------------------
def openai_messages(request: Request) -> list[dict]:
    out: list[dict] = [{"role": "system", "content": request.system}]
    for m in request.messages:
        if m.role == "assistant" and m.call is not None:
            out.append({"role": "assistant", "content": m.text, "tool_calls": [{
                "id": m.call.id, "type": "function",
                "function": {"name": m.call.name, "arguments": json.dumps(m.call.arguments)}}]})
        elif m.role == "tool":
            out.append({"role": "tool", "tool_call_id": m.call.id, "content": m.text})
        else:
            out.append({"role": m.role, "content": m.text})
    return out


def openai_chat(client, model: str) -> Protocol:
    """Requests through the `openai` package's chat.completions (greedy)."""

    def send(request: Request) -> Answer:
        extra = {}
        if request.tools:
            extra["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in request.tools]
        reply = client.chat.completions.create(
            model=model, messages=openai_messages(request), max_tokens=request.max_tokens,
            temperature=0, **extra)
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return Answer(reply.choices[0].message.content or "", usage.prompt_tokens, cached or 0)

    return send
