"""A stdio MCP server for tests: an agent's many MCP tools, as a real integration offers them.

    python tests/mcp_tools_server.py N     N work tools (each with a long description) and
                                           get_weather

It speaks MCP's JSON-RPC over stdin and stdout, one message a line: `initialize`, `tools/list`
and `tools/call` (get_weather answers with WEATHER_MARK; the others echo their arguments).
An agent given it marks its tools `defer_loading` when its tool search is on, which is what
tests/test_agent_clis.py needs of it.
"""

from __future__ import annotations

import json
import sys

WEATHER_MARK = "localllm-mcp-ok: sunny in Paris"
AREAS = ["ticket", "invoice", "calendar", "repository", "channel", "database", "customer",
         "deployment", "document", "spreadsheet"]
VERBS = ["create", "update", "delete", "list", "archive", "export", "assign", "comment_on"]


def tools(n: int) -> list[dict]:
    """`n` tools over ten areas, each about 250 tokens as an integration's are, and
    get_weather among them."""
    made = []
    for i in range(n):
        area, verb = AREAS[i % len(AREAS)], VERBS[i // len(AREAS) % len(VERBS)]
        what = verb.replace("_", " ")
        made.append({
            "name": f"{verb}_{area}_{i}",
            "description": (
                f"{what.capitalize()} a {area} in the team's workspace and return its new "
                f"state as JSON. Use this when the user asks to {what} a {area} by its id or "
                f"title; the {area} must exist and the caller must be allowed to {what} it. "
                "The answer holds every field of the record, its history of changes, the "
                "people watching it and the links to related records, so a follow-up call is "
                "rarely needed. Errors come back as a JSON object with a code and a message: "
                "not_found when no record has that id, forbidden when the workspace's rules "
                "do not allow the change, conflict when someone changed the record since it "
                "was read (read it again and retry), and rate_limited when too many calls "
                "were made in the last minute (wait and retry). Dates are ISO 8601 in UTC."),
            "inputSchema": {"type": "object", "properties": {
                f"{area}_id": {"type": "string", "description": f"The {area}'s id"},
                "note": {"type": "string", "description": "Why, for the audit log"},
                "notify": {"type": "boolean", "description": "Tell the watchers"}},
                "required": [f"{area}_id"]}})
    weather = {"name": "get_weather", "description": "Get the current weather for a city.",
               "inputSchema": {"type": "object", "properties": {
                   "city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}
    return [*made[:n // 2], weather, *made[n // 2:]]


def answer(message: dict, offered: list[dict]) -> dict | None:
    method, params = message.get("method"), message.get("params") or {}
    if "id" not in message:  # a notification
        return None
    if method == "initialize":
        result = {"protocolVersion": params.get("protocolVersion", "2025-06-18"),
                  "capabilities": {"tools": {}},
                  "serverInfo": {"name": "work", "version": "1.0.0"}}
    elif method == "tools/list":
        result = {"tools": offered}
    elif method == "tools/call":
        name, arguments = params.get("name"), params.get("arguments") or {}
        text = WEATHER_MARK if name == "get_weather" else json.dumps(arguments)
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": message["id"],
                "error": {"code": -32601, "message": f"no method {method}"}}
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


def main() -> None:
    offered = tools(int(sys.argv[1]))
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = answer(json.loads(line), offered)
        if reply is not None:
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
