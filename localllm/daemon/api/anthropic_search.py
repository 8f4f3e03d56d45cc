"""Tool search on /v1/messages, run by this server as Anthropic's API runs it.

A request's `tools` may hold tools marked `defer_loading` (an agent's MCP tools) and a tool
search tool (`tool_search_tool_regex_20251119` or `tool_search_tool_bm25_20251119`, by the name
the client gives it). The deferred tools are indexed, not rendered (chat/tool_search.py); the
search tool is offered to the model as a function. When the model calls it, the search runs
here, within the same request: the answer gets a `server_tool_use` block and a
`tool_search_tool_result` block of `tool_reference`s, the found tools' definitions are appended
to the conversation as the call's result, and the model goes on. The client sends both blocks
back in the assistant's turn; they are read into the same messages again, so the next prompt
starts as this one did and its cached tokens are reused.

A `tool_reference` in a `tool_result` (a search the client ran itself, as Claude Code's own
ToolSearch tool does) brings the referenced tools' definitions into that result the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from localllm.engine.runner.protocol import Done

from ..chat.parse import ToolCall
from ..chat.request import ChatRequest
from ..chat.tool_search import BM25, REGEX, BadQuery, DeferredTools, search_tool
from localllm.engine.runner.protocol import new_request_id
from .common import bad_request

SEARCH_TYPES = {"tool_search_tool_regex": REGEX, "tool_search_tool_bm25": BM25}
MAX_SEARCHES = 5  # searches one answer runs; past them it pauses (stop_reason pause_turn)


def search_kind(tool_type) -> str | None:
    """REGEX or BM25 for a tool search tool's type (any version of it), else None."""
    if not isinstance(tool_type, str):
        return None
    return next((kind for prefix, kind in SEARCH_TYPES.items()
                 if tool_type == prefix or tool_type.startswith(prefix + "_")), None)


@dataclass(frozen=True)
class Tools:
    """A request's tools: those rendered into the prompt, the deferred ones, and the search
    tools offered (name -> REGEX or BM25)."""
    offered: tuple[dict, ...] = ()
    deferred: DeferredTools = field(default_factory=DeferredTools)
    searches: dict[str, str] = field(default_factory=dict)


def anthropic_tools(body: dict) -> Tools:
    """`tools`: custom tools with `input_schema` as function tools (deferred ones set aside),
    the tool search tools offered as functions; Anthropic's other server and versioned tools
    (web_search, bash, text_editor...) are left out: nothing here runs them."""
    tools = body.get("tools")
    if tools is None:
        return Tools()
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_request("field 'tools' must be a list of tool objects", "tools")
    offered, deferred, searches = [], [], {}
    for i, tool in enumerate(tools):
        name, kind = tool.get("name"), search_kind(tool.get("type"))
        if kind is not None:
            searches[str(name or tool["type"])] = kind
            offered.append(search_tool(str(name or tool["type"]), kind))
            continue
        if tool.get("type") not in (None, "custom"):
            continue
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].name must be a string", "tools")
        if not isinstance(schema, dict):
            raise bad_request(f"tools[{i}].input_schema must be a JSON schema object", "tools")
        function = {"type": "function", "function": {
            "name": name, "description": str(tool.get("description") or ""),
            "parameters": schema}}
        (deferred if tool.get("defer_loading") else offered).append(function)
    return Tools(tuple(offered), DeferredTools(tuple(deferred)), searches)


# ---- the blocks --------------------------------------------------------------------------------
def server_use_block(call: ToolCall) -> dict:
    return {"type": "server_tool_use", "id": "srvtoolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.arguments}


def references(block: dict) -> tuple[list[str], str | None]:
    """(the tool names a tool_search_tool_result block references, its error message)."""
    content = block.get("content")
    if not isinstance(content, dict):
        return [], "the search failed"
    if content.get("type") == "tool_search_tool_result_error":
        return [], str(content.get("error_message") or content.get("error_code") or "error")
    found = content.get("tool_references")
    return [str(r.get("tool_name")) for r in found or () if isinstance(r, dict)], None


def result_text(block: dict, deferred: DeferredTools) -> str:
    """What the model reads as a search's result: the definitions of the tools it found."""
    names, error = references(block)
    return f"Error: {error}" if error is not None else deferred.definitions(names)


async def result_block(call: ToolCall, kind: str, deferred: DeferredTools) -> dict:
    """The search `call` asks for, run (in a thread: its time grows with the tools and the
    pattern): its tool_search_tool_result block."""
    use_id = server_use_block(call)["id"]
    try:
        names = await asyncio.to_thread(deferred.search, kind, call.arguments.get(
            "query", call.arguments.get("pattern")))
    except BadQuery as e:
        return {"type": "tool_search_tool_result", "tool_use_id": use_id, "content": {
            "type": "tool_search_tool_result_error", "error_code": "invalid_tool_input",
            "error_message": str(e)}}
    return {"type": "tool_search_tool_result", "tool_use_id": use_id, "content": {
        "type": "tool_search_tool_search_result",
        "tool_references": [{"type": "tool_reference", "tool_name": n} for n in names]}}


# ---- one answer's searches ---------------------------------------------------------------------
class SearchRun:
    """The searches of one /v1/messages answer: which calls the server runs, the blocks the
    answer has so far, and the request that goes on after a search."""

    def __init__(self, chat: ChatRequest, tools: Tools, turns):
        self.chat, self.tools = chat, tools
        self.turns = turns  # the assistant's blocks -> messages (anthropic.assistant_turns)
        self.blocks: list[dict] = []  # the answer's content so far, as the client gets it
        self.earlier: list[Done] = []  # the generations before the current one
        self.searched = 0
        self.client_calls = False  # the current generation called a tool of the client's
        self.searched_now = False  # the current generation called the search tool
        self.paused = False  # the answer stopped at its search limit, the last result unread

    def is_search(self, call: ToolCall) -> bool:
        return call.name in self.tools.searches

    async def run(self, call: ToolCall) -> list[dict]:
        """A search call of the model's, run: its server_tool_use and result blocks."""
        self.searched += 1
        self.searched_now = True
        return [server_use_block(call), await result_block(
            call, self.tools.searches[call.name], self.tools.deferred)]

    def next_request(self, done: Done) -> ChatRequest | None:
        """After a generation: the request that lets the model read its search results (None
        when it called none, called one of the client's tools too, or hit the limit: then
        `paused` says so)."""
        searched, self.searched_now = self.searched_now, False
        client, self.client_calls = self.client_calls, False
        if not searched or client or done.done_reason != "stop":
            return None
        if self.searched >= MAX_SEARCHES:
            self.paused = True
            return None
        self.earlier.append(done)
        choice = self.chat.tool_choice
        if isinstance(choice, dict) and choice.get("name") in self.tools.searches:
            choice = "auto"  # the search was asked for, and done: the model may now answer
        messages = (*self.chat.messages, *self.turns(self.blocks, self.tools))
        options = self.chat.options
        if options.num_predict > 0:  # max_tokens holds for the whole answer
            spent = sum(d.eval_count for d in self.earlier)
            options = replace(options, num_predict=max(1, options.num_predict - spent))
        return replace(self.chat, id=new_request_id(), messages=messages, tool_choice=choice,
                       options=options)

    def usage(self, done: Done) -> dict:
        """Usage over every generation of the answer: the tokens read afresh and those reused
        from the cache, each generation's prompt counted once."""
        every = [*self.earlier, done]
        cached = sum(d.cached_tokens for d in every)
        return {"input_tokens": sum(d.prompt_tokens for d in every) - cached,
                "output_tokens": sum(d.eval_count for d in every),
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

