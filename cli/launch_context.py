"""The context a coding agent needs before the user says anything, and the load that gives it.

Each agent's first request (its system prompt and tools, recorded from the real CLI at a
pinned version: agent_requests/, replayed by tests/test_agent_clis.py) is sent to the daemon's
token count for its wire format, which renders it with the chosen model's template and counts
it with the model's tokenizer. The model is loaded with a context that holds that request plus
room for an answer (`ANSWER_MIN` at least); where the model's trained length or the largest
context its plan fits on this card is less, the agent cannot run on it and `launch` says so.
"""

from __future__ import annotations

import json
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


def first_request(agent: str) -> tuple[str, dict]:
    """The route and body of the agent's recorded first request."""
    recorded = json.loads((REQUESTS / FIRST_REQUESTS[agent]).read_text())
    return recorded["path"], recorded["body"]


async def first_request_tokens(client, agent: str, model: str) -> int:
    """The agent's first request, with `model` named in it, counted by the daemon (which loads
    the model to count where it is not loaded)."""
    path, body = first_request(agent)
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
