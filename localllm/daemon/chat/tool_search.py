"""Deferred tools: kept out of the prompt, found by a search the model asks for, and put in
front of it as a tool result when found.

An agent with a hundred MCP tools marks them `defer_loading`; their definitions stay here,
indexed by name, description and parameter names, and the model is offered one search tool
instead. A search by regular expression (Python's `re.search`, over the same text, run in the
template worker under a time limit: a backtracking pattern must not hold the daemon) or by BM25
(keywords) names the tools that match; their definitions then come into the conversation as
the search call's result, after the turns so far, so the prompt before it (the system prompt
and the tools that were rendered) stays as it was and its cached tokens are reused.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter

from .template import search_in_worker

REGEX, BM25 = "regex", "bm25"
MAX_FOUND = 5  # tools one search returns, best first (as Anthropic's search returns 3-5)
MAX_PATTERN = 200  # characters of a regular expression, as Anthropic's limit

DESCRIPTIONS = {
    REGEX: "Search the tools that are not listed yet, by a regular expression (Python re.search "
           "syntax, e.g. \"weather\" or \"(?i)slack.*send\") matched against their names, "
           "descriptions and parameter names. The tools found become callable.",
    BM25: "Search the tools that are not listed yet, by keywords in natural language (e.g. "
          "\"send a message to a channel\") matched against their names, descriptions and "
          "parameter names. The tools found become callable.",
}


class BadQuery(ValueError):
    """A search the index cannot run (an empty query, a regular expression that does not
    compile or is too long)."""


def search_tool(name: str, kind: str) -> dict:
    """The search tool as the model is offered it: a function tool of the client's name."""
    what = "regular expression" if kind == REGEX else "keywords"
    return {"type": "function", "function": {
        "name": name, "description": DESCRIPTIONS[kind],
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": f"The {what} to search for"}},
            "required": ["query"]}}}


def _words(text: str) -> list[str]:
    """Lower-case words of a name or a sentence: snake_case, kebab-case, dotted and camelCase
    names split into their parts."""
    text = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", text)
    return [w for w in re.split(r"[^A-Za-z0-9]+", text.lower()) if w]


def _parameter_names(schema) -> list[str]:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict):
        return []
    names = []
    for key, sub in properties.items():
        names.append(str(key))
        names += _parameter_names(sub)
    return names


class DeferredTools:
    """The request's deferred tools (function tools in the chat layer's shape), by name."""

    def __init__(self, tools: tuple[dict, ...] = ()):
        self.tools = tools
        # by name, the first of a name winning: a request may reference 20,000 tools
        self._by_name: dict[str, dict] = {}
        for tool in tools:
            self._by_name.setdefault(tool["function"]["name"], tool)
        # What a search reads of each tool: its name, description and parameter names.
        self._docs = [(f["name"], "\n".join([f["name"], f.get("description") or "",
                                             *_parameter_names(f.get("parameters"))]))
                      for f in (tool["function"] for tool in tools)]

    def __bool__(self) -> bool:
        return bool(self.tools)

    def get(self, name: str) -> dict | None:
        return self._by_name.get(name)

    def search(self, kind: str, query) -> list[str]:
        """Names of the tools `query` finds, best first, at most MAX_FOUND. Blocking (a worker
        process, or BM25 over every tool): callers on the event loop run it in a thread."""
        if not isinstance(query, str) or not query.strip():
            raise BadQuery("the query must be a non-empty string")
        return self.regex(query) if kind == REGEX else self.bm25(query)

    def regex(self, pattern: str) -> list[str]:
        if len(pattern) > MAX_PATTERN:
            raise BadQuery(f"the pattern is {len(pattern)} characters; at most {MAX_PATTERN}")
        try:
            re.compile(pattern)  # (its error said here; the match runs in the worker)
        except re.error as e:
            raise BadQuery(f"the pattern is not a regular expression Python reads: {e}") from None
        if not self._docs:
            return []
        try:
            found = search_in_worker(pattern, [text for _, text in self._docs], MAX_FOUND)
        except TimeoutError:
            raise BadQuery("the pattern took too long to match (it backtracks: nested "
                           "repeats such as (a+)+); search with a simpler one") from None
        except ValueError as e:
            raise BadQuery(str(e)) from None
        return [self._docs[i][0] for i in found]

    def bm25(self, query: str, k1: float = 1.2, b: float = 0.75) -> list[str]:
        """Okapi BM25 over each tool's words (name, description, parameter names)."""
        terms = set(_words(query))
        docs = [(name, Counter(_words(text))) for name, text in self._docs]
        if not terms or not docs:
            return []
        average = sum(sum(c.values()) for _, c in docs) / len(docs) or 1
        having = Counter(t for _, c in docs for t in terms if t in c)
        scored = []
        for name, counts in docs:
            length, score = sum(counts.values()), 0.0
            for term in terms:
                tf = counts.get(term, 0)
                if tf:
                    idf = math.log(1 + (len(docs) - having[term] + 0.5) / (having[term] + 0.5))
                    score += idf * tf * (k1 + 1) / (tf + k1 * (1 - b + b * length / average))
            if score > 0:
                scored.append((-score, name))
        return [name for _, name in sorted(scored)][:MAX_FOUND]

    def definitions(self, names: list[str]) -> str:
        """The text a search's (or a tool reference's) result carries: the definitions of the
        tools named, one JSON object a line, as templates list tools."""
        # each tool once: a request may reference one tool thousands of times
        found = [tool for tool in map(self.get, dict.fromkeys(names)) if tool is not None]
        if not found:
            return "No tools matched. Search again with other words, or answer without them."
        return ("These tools can now be called like the others:\n"
                + "\n".join(json.dumps(tool, ensure_ascii=False) for tool in found))
