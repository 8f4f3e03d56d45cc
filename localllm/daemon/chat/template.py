"""Hugging Face chat templates: what a template tells about its model (whether it takes tools,
in which format its model writes tool calls, how it separates thinking from the answer), and
rendering one, with jinja2, in a sandboxed worker process (template_worker.py) under time, size
and memory limits.

Templates get the variables HF's `apply_chat_template` passes: `messages`, `tools`,
`add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`, `strftime_now`, plus the
thinking switches templates read (`enable_thinking`, `reasoning_effort`).

`render` is blocking and thread-safe: the chat layer calls it from a worker thread, never on the
event loop. Each call takes an idle worker (or starts one), sends the template and its
variables, and waits at most RENDER_SECONDS for the text. A worker past the limit is killed,
which stops the render for certain (a thread could not be stopped), and the caller gets a
TemplateFailed naming the limit; a worker past its memory cap says so itself. A worker that died
without a word (killed, crashed) is not the template's fault: the render is tried once more on a
fresh worker, then is a 503. Idle workers are kept for the next render, so a render costs a pipe
round trip, not a process start. The pipes are waited on with poll(), not select(), which fails
on descriptors past 1023 (a daemon holding a thousand connections).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from localllm.errors import UserError

from .template_worker import HEADER

RENDER_SECONDS = 2.0
SEARCH_SECONDS = 1.0  # a tool search's regular expression over the deferred tools' text
KEEP_IDLE = 4
WORKER_COMMAND = (sys.executable, "-m", "localllm.daemon.chat.template_worker")

# Tool-call formats (how the model writes a call) and thinking formats.
HERMES, LLAMA3, MISTRAL, HARMONY, JSON_CALLS = "hermes", "llama3", "mistral", "harmony", "json"
THINK_TAGS, CHANNELS = "think_tags", "channels"


# Ollama's template for a model that brings none (template/template.go: DefaultTemplate):
# `/api/show` reports it under this name, and `render_default` renders it.
DEFAULT_TEMPLATE = "{{ .Prompt }}"


class TemplateFailed(ValueError):
    """The template raised, could not be compiled, or broke a limit (`limit`: "time", "size"
    or "memory"): a 400."""

    def __init__(self, message: str, limit: str | None = None):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class TemplateStyle:
    tools: bool  # the template renders a `tools` list
    tool_format: str | None  # HERMES, LLAMA3, MISTRAL, HARMONY or JSON_CALLS
    thinking: str | None  # THINK_TAGS, CHANNELS or None
    stops: tuple[str, ...] = ()  # end-of-turn markers the template writes


def template_style(template: str | None, architecture: str = "") -> TemplateStyle:
    if not template:
        return TemplateStyle(tools=False, tool_format=None, thinking=None)
    harmony = "<|channel|>" in template or architecture == "gpt-oss"
    tools = "tools" in template or "tool_call" in template
    if harmony:
        tool_format = HARMONY
    elif "<tool_call>" in template:
        tool_format = HERMES
    elif "[TOOL_CALLS]" in template:
        tool_format = MISTRAL
    elif "<|python_tag|>" in template or "ipython" in template:
        tool_format = LLAMA3
    else:
        tool_format = JSON_CALLS
    if harmony:
        thinking = CHANNELS
    elif "<think>" in template and "</think>" in template:
        thinking = THINK_TAGS
    else:
        thinking = None
    stops = tuple(s for s in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|return|>",
                              "<end_of_turn>", "<|endoftext|>") if s in template)
    return TemplateStyle(tools=tools, tool_format=tool_format if tools else None,
                         thinking=thinking, stops=stops)


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None,
           bos: str = "", eos: str = "", think: bool | str | None = None,
           add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`; `think` is None (the template's default), a bool, or
    an effort level ("low", "medium", "high")."""
    variables = {
        "messages": messages,
        "tools": tools or None,
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos,
        "eos_token": eos,
    }
    if think is not None:
        variables["enable_thinking"] = bool(think)
        if isinstance(think, str):
            variables["reasoning_effort"] = think
    return render_in_worker(template, variables)


def render_default(messages: list[dict]) -> str:
    """The prompt Ollama's default template `{{ .Prompt }}` makes of a conversation: the user
    turns' text, one after another. As Ollama's legacy path does, back-to-back messages of one
    role are first joined with a blank line, and system and assistant text is left out (the
    template names only `.Prompt`)."""
    parts: list[str] = []
    previous = None
    for message in messages:
        role = message.get("role")
        if role == "user":
            if previous == "user":
                parts.append("\n\n")
            parts.append(message.get("content") or "")
        previous = role
    return "".join(parts)


# ---- the worker processes --------------------------------------------------------------
class WorkerDied(UserError):
    """The worker ended without answering, twice: retry later (503)."""

    status = 503


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(WORKER_COMMAND, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     start_new_session=True)

    def ask(self, request: bytes, deadline: float) -> dict:
        """Send one request and read its reply; TimeoutError past the deadline, EOFError when
        the worker died."""
        os.write(self.proc.stdin.fileno(), HEADER.pack(len(request)))
        view = memoryview(request)
        while view:  # the worker reads as we write, so a full pipe drains
            view = view[os.write(self.proc.stdin.fileno(), view):]
        header = self._read(HEADER.size, deadline)
        return json.loads(self._read(HEADER.unpack(header)[0], deadline))

    def _read(self, n: int, deadline: float) -> bytes:
        fd, data = self.proc.stdout.fileno(), bytearray()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while len(data) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError
            chunk = os.read(fd, min(n - len(data), 1 << 20))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


_idle: list[_Worker] = []
_lock = threading.Lock()


def _take() -> _Worker:
    with _lock:
        while _idle:
            worker = _idle.pop()
            if worker.proc.poll() is None:
                return worker
            worker.kill()
    return _Worker()


def _give_back(worker: _Worker) -> None:
    with _lock:
        if len(_idle) < KEEP_IDLE:
            _idle.append(worker)
            return
    worker.kill()


@atexit.register
def close_workers() -> None:
    with _lock:
        workers, _idle[:] = list(_idle), []
    for worker in workers:
        worker.kill()


def render_in_worker(template: str, variables: dict, seconds: float = RENDER_SECONDS) -> str:
    try:
        reply = _ask({"template": template, "variables": variables}, seconds)
    except TimeoutError:
        raise TemplateFailed(f"the chat template ran past its time limit of {seconds:g} s",
                             "time") from None
    if "error" in reply:
        raise TemplateFailed(reply["error"], reply.get("limit"))
    return reply["text"]


def search_in_worker(pattern: str, texts: list[str], limit: int,
                     seconds: float = SEARCH_SECONDS) -> list[int]:
    """The indices of the first `limit` of `texts` that the regular expression `pattern`
    matches, found in a worker: TimeoutError past `seconds` (the worker is killed), ValueError
    for a pattern that does not compile."""
    reply = _ask({"regex": pattern, "texts": texts, "limit": limit}, seconds)
    if "error" in reply:
        raise ValueError(reply["error"])
    return reply["found"]


def _ask(request: dict, seconds: float) -> dict:
    """One request answered by an idle worker (or a new one): TimeoutError past `seconds`, the
    worker killed; a worker that dies without answering is replaced once, then WorkerDied."""
    data = json.dumps(request, ensure_ascii=False, default=str).encode("utf-8", "surrogatepass")
    deadline = time.monotonic() + seconds
    for attempt in (1, 2):
        worker = _take()
        try:
            reply = worker.ask(data, deadline)
            break
        except TimeoutError:
            worker.kill()
            raise
        except (EOFError, OSError):
            worker.kill()
            if attempt == 2:
                raise WorkerDied(f"the chat template's worker process ended without answering "
                                 f"({_exit_text(worker.proc.returncode)}); try again") from None
        except BaseException:
            worker.kill()
            raise
    _give_back(worker)
    return reply


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"
