"""The context a coding agent needs before the user says anything, and the load that gives it.

Each agent's first request (its system prompt and tools, recorded from the real CLI at a
pinned version: agent_requests/, replayed by tests/test_agent_clis.py) is sent to the daemon's
token count for its wire format, which renders it with the chosen model's template and counts
it with the model's tokenizer; where the agent is told to offer fewer of its tools (Claude
Code's `--tools` and `--disallowedTools`, after `--`), only those it will send are counted.
The model is loaded with a context that holds that request plus
room for an answer (`ANSWER_MIN` at least); where the model's trained length or the largest
context its plan fits on this card is less, the agent cannot run on it and `launch` says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from localllm.errors import UserError

ANSWER_MIN = 4096  # the least room for an answer an agent is loaded with
ROUND_TO = 1024  # a fitted context is a whole number of these
REQUESTS = Path(__file__).resolve().parent / "agent_requests"
FIRST_REQUESTS = {"claude": "claude-code-2.1.332-default.json",
                  "codex": "codex-0.169.0-first.json",
                  "copilot": "copilot-1.0.102-chat.json",
                  "opencode": "opencode-1.18.33-chat.json"}
COUNT_ROUTES = {"/v1/messages": "/v1/messages/count_tokens",
                "/v1/responses": "/v1/responses/input_tokens",
                "/v1/chat/completions": "/v1/chat/completions/input_tokens"}
# Claude Code's flags that change which of its tools it sends: `--tools` names the only built-in
# tools it offers ("default": all of them, "": none), `--disallowedTools` takes tools away (a
# rule with arguments, `Bash(git *)`, only limits what the tool may run: it is still sent). Each
# takes names separated by commas or spaces, in one argument or several.
KEEP_FLAGS = {"claude": ("--tools",)}
DROP_FLAGS = {"claude": ("--disallowedTools", "--disallowed-tools")}
ALWAYS_SENT = {"claude": {"DeferredToolPlaceholder"}}  # sent whichever tools it is told of


@dataclass(frozen=True)
class Need:
    """What the agent takes of the context: its first request and the least answer room."""
    agent: str  # its name, as a user reads it
    first_request: int  # tokens, with this model's template and tokenizer

    @property
    def tokens(self) -> int:
        return self.first_request + ANSWER_MIN

    @property
    def context(self) -> int:
        """The context to load where a larger one is not wanted: `tokens`, rounded up."""
        return -(-self.tokens // ROUND_TO) * ROUND_TO

    def why(self) -> str:
        return (f"{self.agent}'s first request is {self.first_request} tokens (its system "
                f"prompt and tools) and its answers need {ANSWER_MIN} more")


def first_request(agent: str, agent_args: list[str] | tuple = ()) -> tuple[str, dict]:
    """The route and body of the agent's recorded first request, with only the tools it sends
    when run with `agent_args`."""
    recorded = json.loads((REQUESTS / FIRST_REQUESTS[agent]).read_text())
    body = recorded["body"]
    keep = flag_values(agent_args, KEEP_FLAGS.get(agent, ()))
    drop = {name for name in flag_values(agent_args, DROP_FLAGS.get(agent, ())) or ()
            if "(" not in name}
    if keep is None and not drop:
        return recorded["path"], body
    wanted = ALWAYS_SENT.get(agent, set()) | (keep if keep is not None else set())
    body = {**body, "tools": [
        tool for tool in body.get("tools") or () if tool_name(tool) not in drop
        and (keep is None or "default" in keep or tool_name(tool) in wanted)]}
    return recorded["path"], body


def tool_name(tool: dict) -> str:
    return tool.get("name") or (tool.get("function") or {}).get("name") or ""


def flag_values(args, flags: tuple[str, ...]) -> set[str] | None:
    """The names given to any of `flags` in `args` (`--tools A,B`, `--tools A B`,
    `--tools=A`), or None where none of them is passed."""
    values, found, reading = [], False, False
    for arg in args:
        if reading and not arg.startswith("-"):
            values.append(arg)
            continue
        reading = arg in flags
        found = found or reading
        name, equals, value = arg.partition("=")
        if equals and name in flags:
            found = True
            values.append(value)
    if not found:
        return None
    return {name for value in values for name in re.split(r"[,\s]+", value) if name}


async def first_request_tokens(client, agent: str, model: str,
                               agent_args: list[str] | tuple = ()) -> int:
    """The agent's first request (as `agent_args` make it), with `model` named in it, counted
    by the daemon (which loads the model to count where it is not loaded)."""
    path, body = first_request(agent, agent_args)
    body = {key: value for key, value in body.items() if key != "stream_options"}
    counted = await client.request("POST", COUNT_ROUTES[path],
                                   {**body, "model": model, "stream": False})
    return int(counted["input_tokens"])


def answer_room(n_ctx: int, first_request: int = 0) -> int:
    """The answer size an agent is told to ask for: a quarter of the context, at least
    ANSWER_MIN, and never more than the context leaves after its first request. (The daemon
    takes any max_tokens as a ceiling; an agent subtracts it from the window it plans for.)"""
    room = max(ANSWER_MIN, n_ctx // 4)
    if first_request:
        room = min(room, n_ctx - first_request)
    return max(256, min(room, n_ctx // 2))


def check_trained(model: str, trained: int, need: Need) -> None:
    if trained and trained < need.tokens:
        raise UserError(f"{model} cannot run {need.agent}: {need.why()}, but {model} was "
                        f"trained on {trained} tokens; use a model with a longer context")


def too_small_for_card(model: str, largest: int, need: Need, error: str) -> UserError:
    return UserError(f"{model} cannot run {need.agent} here: {need.why()}, but the largest "
                     f"context that fits is {largest} tokens ({error}); use a smaller model, or "
                     f"give this one more memory")
