"""The process that renders chat templates, and the limits a template renders under.

A chat template is code from whoever made the model or wrote the Modelfile (/api/create). It
renders here, in a child of the daemon, in jinja2's immutable sandbox (no attribute of Python
internals, no mutation of the request), so that:
- a template that runs too long is killed by the daemon (template.py) without a thread
  left spinning: Python threads cannot be stopped, processes can;
- a template that builds a huge value fails at once: `*`, `+` and `**` are intercepted (which also
  stops jinja folding `"a" * 10**10` at compile time), `replace` is sized before it runs, every
  call's result is sized, output is counted as it is produced, all against the 8 MiB cap of a
  request's text, and the process's address space is capped (RLIMIT_AS) for whatever else
  allocates;
- a template nested past MAX_NESTING blocks, or one that recurses past Python's limit, is an
  error naming the limit, and the worker lives on;
- the daemon's event loop and memory are never the template's.

A tool search's regular expression (chat/tool_search.py) runs here too, for the same reason:
Python's `re` backtracks, so a pattern like `(a+)+b` (the model writes it: a template or a
prompt injection can choose it) takes time doubling with each letter of the text, and only a
process can be stopped mid-match.

Wire: one JSON object per message, each prefixed by its length (4 bytes, big-endian), over
stdin/stdout. Request {"template", "variables"}; reply {"text"} or {"error", "limit"}. Request
{"regex", "texts", "limit"}; reply {"found": the indices of the first `limit` texts matched}.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import operator
import re
import resource
import signal
import struct
import sys
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A request's text is capped at 8 MiB (chat/request.py): a prompt may not be larger, and the cap
# holds while the template renders, not after (every piece, every value it builds)
MAX_OUTPUT_CHARS = 8 << 20
MAX_NESTING = 100  # {% if %}, {% for %} ... blocks within blocks; real templates nest a few
MAX_INT_BITS = 1 << 16  # `**` past this many bits of result is refused
MEMORY_LIMIT_BYTES = 1 << 30  # the worker's address space
HEADER = struct.Struct(">I")


class TemplateLimit(Exception):
    """The template broke a limit; the message names it."""


class Raised(Exception):
    """raise_exception() from the template: its own message."""


def _too_long(n: int) -> TemplateLimit:
    return TemplateLimit(f"the chat template built a value of {n:,} characters, past the "
                         f"output size limit of {MAX_OUTPUT_CHARS:,}")


class LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context, op, left, right):
        sized = (str, list, tuple)
        if op == "+":
            if isinstance(left, sized) and isinstance(right, sized) \
                    and len(left) + len(right) > MAX_OUTPUT_CHARS:
                raise _too_long(len(left) + len(right))
            return operator.add(left, right)
        if op == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, sized) and isinstance(times, int) \
                        and len(seq) * times > MAX_OUTPUT_CHARS:
                    raise _too_long(len(seq) * times)
            return operator.mul(left, right)
        if op == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 \
                    and right * math.log2(abs(left)) > MAX_INT_BITS:
                raise TemplateLimit(f"the chat template computed a number past the size "
                                    f"limit of {MAX_INT_BITS:,} bits")
            return operator.pow(left, right)
        return super().call_binop(context, op, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # jinja's own names: no clash
        """A method or function the template calls: `str.replace` is sized before it runs
        (one call can multiply a string), any other result after."""
        if getattr(__obj, "__name__", "") == "replace" and isinstance(
                getattr(__obj, "__self__", None), str):
            _check_replace(__obj.__self__, *args)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list, tuple)) and len(result) > MAX_OUTPUT_CHARS:
            raise _too_long(len(result))
        return result


def _check_replace(text: str, old="", new="", count: int = -1, *rest) -> None:
    if isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        n = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        if len(text) + n * (len(new) - len(old)) > MAX_OUTPUT_CHARS:
            raise _too_long(len(text) + n * (len(new) - len(old)))


def _replace_filter(value, old, new, count=None):
    """jinja's `replace` filter, sized before it runs."""
    text = str(value)
    _check_replace(text, str(old), str(new), -1 if count is None else count)
    return text.replace(str(old), str(new), -1 if count is None else count)


_BLOCK_TAG = re.compile(r"\{%[-+]?\s*(\w+)")
_OPENS = {"if", "for", "macro", "call", "filter", "block", "with", "raw", "trans"}


def _nesting(template: str) -> int:
    """How deep the template's blocks nest (an estimate from its tags, before compiling: the
    compiler recurses once per level and a deep enough template exhausts Python's stack)."""
    depth = deepest = 0
    for word in _BLOCK_TAG.findall(template):
        if word in _OPENS:
            depth += 1
            deepest = max(deepest, depth)
        elif word.startswith("end"):
            depth = max(0, depth - 1)
    return deepest


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    # HF's tojson: no HTML escaping (jinja2's default would turn "<" into "\u003c").
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys,
                      separators=separators)


def _raise(message: str):
    raise Raised(message)


def _strftime_now(fmt: str) -> str:
    return dt.datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile(template: str):
    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters["replace"] = _replace_filter
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_here(template: str, variables: dict) -> dict:
    """One render in this process, as the reply to send."""
    if (depth := _nesting(template)) > MAX_NESTING:
        return {"error": f"the chat template nests its blocks {depth} deep, past the limit of "
                         f"{MAX_NESTING}", "limit": "nesting"}
    try:
        compiled = _compile(template)
    except TemplateError as e:
        return {"error": f"the model's chat template does not compile: {e}"}
    except MemoryError:
        return {"error": _memory_message(), "limit": "memory"}
    except RecursionError:
        return {"error": "the chat template is nested past what can be compiled (recursion "
                         "limit)", "limit": "nesting"}
    pieces, size = [], 0
    try:
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT_CHARS:
                raise _too_long(size)
            pieces.append(piece)
    except TemplateLimit as e:
        return {"error": str(e), "limit": "size"}
    except MemoryError:
        return {"error": _memory_message(), "limit": "memory"}
    except RecursionError:
        return {"error": "the chat template recursed past the recursion limit (a macro that "
                         "calls itself?)", "limit": "nesting"}
    except Raised as e:
        return {"error": str(e)}
    except Exception as e:  # any jinja or Python error the template causes
        return {"error": f"the chat template rejected these messages: {e}"}
    return {"text": "".join(pieces)}


def search_here(pattern: str, texts: list[str], limit: int) -> dict:
    """The indices of the first `limit` texts that `pattern` matches (re.search)."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        return {"error": f"the pattern is not a regular expression Python reads: {e}"}
    found = []
    for i, text in enumerate(texts):
        if compiled.search(text):
            found.append(i)
            if len(found) >= limit:
                break
    return {"found": found}


def _memory_message() -> str:
    return (f"the chat template used more memory than its limit of "
            f"{MEMORY_LIMIT_BYTES >> 20} MiB")


def _read_exactly(stream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the daemon; it ends us
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = _read_exactly(stdin, HEADER.size)
        if header is None:
            return  # the daemon closed the pipe
        body = _read_exactly(stdin, HEADER.unpack(header)[0])
        if body is None:
            return
        try:
            request = json.loads(body)
            reply = (search_here(request["regex"], request["texts"], request["limit"])
                     if "regex" in request else
                     render_here(request["template"], request["variables"]))
            data = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except MemoryError:
            data = json.dumps({"error": _memory_message(), "limit": "memory"}).encode()
        stdout.write(HEADER.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
