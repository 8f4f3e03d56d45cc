"""The process that renders chat templates, and the limits a template renders under.

A chat template is code from whoever made the model or wrote the Modelfile (/api/create). It
renders here, in a child of the daemon, in jinja2's immutable sandbox (no attribute of Python
internals, no mutation of the request), so that:
- a template that runs too long is killed by the daemon (template.py) without a thread
  left spinning: Python threads cannot be stopped, processes can;
- a template that builds a huge value fails at once: `*`, `+` and `**` are intercepted (which also
  stops jinja folding `"a" * 10**10` at compile time), output is counted as it is produced, and
  the process's address space is capped (RLIMIT_AS) for whatever else allocates;
- the daemon's event loop and memory are never the template's.

Wire: one JSON object per message, each prefixed by its length (4 bytes, big-endian), over
stdin/stdout. Request {"template", "variables"}; reply {"text"} or {"error", "limit"}.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import operator
import resource
import signal
import struct
import sys
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_OUTPUT_CHARS = 16 << 20  # far past any context: 16 Mi characters of prompt
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
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_here(template: str, variables: dict) -> dict:
    """One render in this process, as the reply to send."""
    try:
        compiled = _compile(template)
    except TemplateError as e:
        return {"error": f"the model's chat template does not compile: {e}"}
    except MemoryError:
        return {"error": _memory_message(), "limit": "memory"}
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
    except Raised as e:
        return {"error": str(e)}
    except Exception as e:  # any jinja or Python error the template causes
        return {"error": f"the chat template rejected these messages: {e}"}
    return {"text": "".join(pieces)}


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
            reply = render_here(request["template"], request["variables"])
            data = json.dumps(reply, ensure_ascii=False).encode("utf-8", "surrogatepass")
        except MemoryError:
            data = json.dumps({"error": _memory_message(), "limit": "memory"}).encode()
        stdout.write(HEADER.pack(len(data)) + data)
        stdout.flush()


if __name__ == "__main__":
    main()
