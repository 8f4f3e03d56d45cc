"""System messages in the middle of a conversation, placed where the model's template can take
them.

Agents send them: Claude Code writes its environment as a `role: "system"` message after the
user's first turn, and OpenAI clients may send `developer` messages at any point. Many templates
take a system message only first (Gemma, Mistral and Llama 2 style templates raise, others drop
it without a word). So each template is asked once, with a marked probe, whether it writes a
system message that comes after other turns; where it does, the messages go to it as they are.
Where it does not, the leading system messages become one, and each later one is merged into
the next user turn (else the user turn before it, else a user turn of its own), wrapped in
<system> tags so the model can tell it from the user's words.
"""

from __future__ import annotations

import threading

from .template import TemplateFailed, render

PROBE = "localllm-probe-3f1c: a system message after other turns"
_PROBE_MESSAGES = (
    {"role": "system", "content": "first"},
    {"role": "user", "content": "question"},
    {"role": "assistant", "content": "answer"},
    {"role": "system", "content": PROBE},
    {"role": "user", "content": "question"},
)

_placeable: dict[tuple[str, str, str], bool] = {}
_lock = threading.Lock()


def places_mid_system(template: str, bos: str = "", eos: str = "") -> bool:
    """Whether `template` writes a system message that follows other turns (rendered once per
    template, in the template worker; blocking: call it off the event loop)."""
    key = (template, bos, eos)
    with _lock:
        known = _placeable.get(key)
    if known is not None:
        return known
    try:
        placed = PROBE in render(template, [dict(m) for m in _PROBE_MESSAGES], bos=bos,
                                 eos=eos)
    except TemplateFailed:
        placed = False
    with _lock:
        _placeable[key] = placed
    return placed


def marked(text: str) -> str:
    return f"<system>\n{text}\n</system>"


def _joined(*texts: str) -> str:
    return "\n\n".join(t for t in texts if t)


def fold_system_messages(messages: list[dict]) -> list[dict]:
    """The messages with only one system message, first: the leading ones joined into it, each
    later one merged (marked) into the next user turn, else into the last user turn before it,
    else standing as a user turn of its own."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    head = [m["content"] for m in messages[:lead] if m.get("content")]
    out: list[dict] = [{"role": "system", "content": "\n\n".join(head)}] if head else []
    pending: list[str] = []  # system texts waiting for the next user turn
    for message in messages[lead:]:
        if message["role"] == "system":
            if message.get("content"):
                pending.append(marked(message["content"]))
            continue
        if message["role"] == "user" and pending:
            message = {**message, "content": _joined(*pending, message["content"])}
            pending = []
        out.append(message)
    if pending:  # no user turn after them
        last = out[-1] if out else None
        if last is not None and last["role"] == "user":
            out[-1] = {**last, "content": _joined(last["content"], *pending)}
        else:
            out.append({"role": "user", "content": _joined(*pending)})
    return out


def has_mid_system(messages: list[dict]) -> bool:
    """Whether a system message follows any other message (the first is every template's)."""
    return any(m["role"] == "system" for m in messages[1:])


def place_system_messages(messages: list[dict], template: str, bos: str = "",
                          eos: str = "") -> list[dict]:
    """`messages` as the template can render them (see the module's docstring)."""
    if not has_mid_system(messages) or places_mid_system(template, bos, eos):
        return messages
    return fold_system_messages(messages)
