"""The chat's widgets: a message, a note, the prompt box, the stats line and the progress line."""

from __future__ import annotations

from dataclasses import dataclass

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.content import Content
from textual.message import Message
from textual.widget import Widget
from textual.widgets import Label, Markdown, ProgressBar, Static, TextArea
from textual.widgets._markdown import MarkdownFence

from . import keys
from .slash import common_prefix, completions
from .stats import Segment, fit_line

BLOCK = '"""'


@dataclass
class Entry:
    """A message of the open chat: its text, its row in the database and its widget."""
    role: str
    content: str
    state: str = "done"
    db_id: int | None = None
    view: MessageView | None = None
    # base64 images sent with this turn (image files the prompt named, as `ollama run` takes
    # them), stored with it: a reopened chat sends them again
    images: tuple[str, ...] = ()


def hard_breaks(text: str) -> str:
    """The model's single line breaks kept as line breaks (Markdown would join the lines of a
    poem or of a list written one item a line into one paragraph), outside code blocks, whose
    lines are kept as they are anyway."""
    out, fenced = [], False
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        last = i == len(lines) - 1
        keep = fenced or last or not line.strip() or not lines[i + 1].strip() \
            or line.endswith("  ")
        out.append(line if keep else line + "  ")
    return "\n".join(out)


class MessageView(Vertical):
    """One message of the chat: who, the Markdown text, and (for answers) what it cost."""

    def __init__(self, role: str, content: str = "", who: str = "", footer: str = "",
                 state: str = "done"):
        super().__init__(classes=f"message {role} {state}")
        self.role = role
        self.content = content
        self.who = who or {"user": "You", "assistant": "Assistant"}.get(role, role)
        self.footer = footer
        self.markdown = Markdown(hard_breaks(content))
        self.footer_line = Static(footer, classes="footer", markup=False)

    def compose(self) -> ComposeResult:
        yield Label(self.who, classes="who")
        if self.role == "user":  # as typed: line breaks kept, nothing taken for Markdown
            yield Static(self.content, classes="text", markup=False)
        else:
            yield self.markdown
            yield self.footer_line

    def finish(self, content: str, footer: str, state: str) -> None:
        self.content, self.footer = content, footer
        self.remove_class("streaming")
        self.set_class(state == "stopped", "stopped")
        self.set_class(state == "error", "error")
        self.footer_line.update(footer)

    def on_click(self, event: events.Click) -> None:
        """Copy the message, or only the code of the code block that was clicked."""
        node = event.widget
        while node is not None and node is not self:
            if isinstance(node, MarkdownFence):
                self.app.copy_to_clipboard(node.code)
                self.app.notify("Code block copied", timeout=2)
                return
            node = node.parent
        self.app.copy_to_clipboard(self.content)
        self.app.notify("Message copied", timeout=2)


class Note(Static):
    """Something the app says (help, errors, what loaded): plain text, never sent to the model."""

    def __init__(self, text: str, kind: str = "info"):
        super().__init__(text, classes=f"note {kind}", markup=False)
        self.kind = kind
        self.text = text


def open_block(text: str) -> bool:
    """Inside a `\"\"\"` block that has not been closed yet: Enter adds a line."""
    stripped = text.strip()
    return stripped.startswith(BLOCK) and (len(stripped) < 6 or not stripped.endswith(BLOCK))


def unwrap_block(text: str) -> str:
    stripped = text.strip()
    if stripped.startswith(BLOCK) and stripped.endswith(BLOCK) and len(stripped) >= 6:
        return stripped[3:-3].strip("\n")
    return text


class PromptInput(TextArea):
    """The prompt box: Enter sends, Shift+Enter / Ctrl+J / a \"\"\" block give new lines,
    Up and Down at the first and last line recall earlier prompts, Tab completes commands."""

    BINDINGS = keys.bindings("input")

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    class Suggest(Message):
        """Completions for a partly typed command (empty: nothing to suggest)."""

        def __init__(self, candidates: list[str]):
            super().__init__()
            self.candidates = candidates

    def __init__(self, history: list[str] | None = None, models: list[str] | None = None,
                 keymap: dict[str, str] | None = None):
        super().__init__(soft_wrap=True, tab_behavior="focus", compact=True,
                         highlight_cursor_line=False, id="prompt",
                         placeholder="Send a message (/? for help)")
        self.key_actions = keys.input_actions(keymap or {})
        self.prompts = list(history or [])
        self.models = models if models is not None else []
        self._recall = len(self.prompts)  # index into history; len() means the draft
        self._draft = ""

    async def _on_key(self, event: events.Key) -> None:
        action = self.key_actions.get(event.key)
        if action is None:
            await super()._on_key(event)
            return
        event.stop()
        event.prevent_default()
        getattr(self, f"action_{action}")()

    def action_submit(self) -> None:
        text = self.text
        if open_block(text):
            self.insert("\n")
            return
        if not text.strip():
            return
        if not self.prompts or self.prompts[-1] != text:
            self.prompts.append(text)
        self._recall, self._draft = len(self.prompts), ""
        self.clear()
        self.post_message(self.Submitted(unwrap_block(text)))

    def action_new_line(self) -> None:
        self.insert("\n")

    def action_complete(self) -> None:
        candidates = completions(self.text, self.models)
        if not candidates:
            return
        done = candidates[0] + " " if len(candidates) == 1 else common_prefix(candidates)
        if len(done) > len(self.text):
            self.load_text(done)  # its Changed event shows what can follow
            self.move_cursor(self.document.end)

    def suggestions(self) -> list[str]:
        """What could come next in a partly typed command (only its last word, to be short)."""
        text = self.text
        candidates = completions(text, self.models)
        if len(candidates) == 1 and candidates[0] == text.rstrip():
            return []
        return [c.rsplit(" ", 1)[-1] for c in candidates]

    def action_cursor_up(self, select: bool = False) -> None:
        if select or not self.navigator.is_first_wrapped_line(self.cursor_location) or \
                self._recall == 0:
            return super().action_cursor_up(select)
        if self._recall == len(self.prompts):
            self._draft = self.text
        self._recall -= 1
        self._show(self.prompts[self._recall])

    def action_cursor_down(self, select: bool = False) -> None:
        if select or not self.navigator.is_last_wrapped_line(self.cursor_location) or \
                self._recall >= len(self.prompts):
            return super().action_cursor_down(select)
        self._recall += 1
        self._show(self.prompts[self._recall] if self._recall < len(self.prompts)
                   else self._draft)

    def _show(self, text: str) -> None:
        self.load_text(text)
        self.move_cursor(self.document.end)

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        self.post_message(self.Suggest(self.suggestions()))


class StatsLine(Widget):
    """The one-line stats under the chat; drops its least important parts to fit.

    A plain widget rather than a Static: its size never changes, so a new figure repaints
    this one line instead of laying out the whole screen again (ten times a second).
    """

    def __init__(self):
        super().__init__(id="stats")
        self.parts: list[Segment] = []

    def show(self, parts: list[Segment]) -> None:
        if parts != self.parts:
            self.parts = parts
            self.refresh()

    def render(self) -> Content:
        return Content(fit_line(self.parts, max(self.content_size.width, 20)))


class ProgressLine(Horizontal):
    """What the app is waiting for (starting the daemon, pulling, loading), with progress."""

    def compose(self) -> ComposeResult:
        yield Label("", id="progress-label")
        yield ProgressBar(total=None, show_eta=False, id="progress-bar")

    def start(self, label: str, total: float | None = None) -> None:
        self.query_one("#progress-label", Label).update(label)
        self.query_one(ProgressBar).update(total=total, progress=0)
        self.display = True

    def label(self, label: str) -> None:
        self.query_one("#progress-label", Label).update(label)

    def advance(self, label: str, completed: float, total: float | None) -> None:
        self.query_one("#progress-label", Label).update(label)
        self.query_one(ProgressBar).update(total=total, progress=completed)

    def stop(self) -> None:
        self.display = False
