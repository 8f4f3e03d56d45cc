"""Compaction: a conversation summarised by the model, on the prompt it has cached.

An agent near the end of its context asks for a summary of the conversation, then goes on from
the summary alone. A cloud API reads the whole transcript again to write it; here the request
for the summary is the conversation as it is with one more user turn (the instruction) after
it, so the runner reuses the cached prompt of the last turn and reads only the instruction. The
summary comes back later as a user turn of its own (`summary_message`) in front of what
followed it.
"""

from __future__ import annotations

from dataclasses import replace

from localllm.engine.runner.protocol import new_request_id
from .request import ChatRequest

SUMMARY_PROMPT = (
    "Stop here and write a summary of the conversation so far, to continue from it later "
    "without the conversation: the user's goals and requests, what was done (files, commands, "
    "tool results that matter), decisions made, and what is left to do. Do not call tools; "
    "answer with the summary only.")
SUMMARY_PREFIX = "A summary of the conversation before this point (it was compacted):\n\n"


def summarising(request: ChatRequest, instructions: str | None = None) -> ChatRequest:
    """The request for the summary: the same conversation, tools and settings (so the prompt
    before the instruction is the one the runner holds), the instruction appended as a user
    turn. A forced tool call or output format would leave no room for a summary: they go."""
    choice = "auto" if request.tool_choice not in ("auto", "none") else request.tool_choice
    messages = (*(request.messages or ()), {"role": "user",
                                             "content": instructions or SUMMARY_PROMPT})
    return replace(request, id=new_request_id(), messages=messages, tool_choice=choice,
                   format=None)


def summary_text(content: str, thinking: str) -> str:
    """The summary of an answer: its text (its thinking when a model put it all there)."""
    return content.strip() or thinking.strip()


def summary_message(summary: str) -> dict:
    """The summary as the conversation carries it on: a user turn."""
    return {"role": "user", "content": SUMMARY_PREFIX + summary}
