"""Modal screens: the list of saved chats, and a yes/no question (pull a missing model?)."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, OptionList
from textual.widgets.option_list import Option

from .chatstore import ChatInfo


def chat_row(chat: ChatInfo, width: int = 70) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.updated_at))
    meta = f"{when}  {chat.model}  {chat.n_messages} msg"
    title = chat.title[: max(10, width - len(meta) - 2)]
    return f"{title:<{max(10, width - len(meta) - 2)}}  {meta}"


class ChatListScreen(ModalScreen[int | None]):
    """Saved chats, newest first; Enter opens one, Escape goes back."""

    BINDINGS = [Binding("escape", "dismiss(None)", "back")]

    def __init__(self, chats: list[ChatInfo]):
        super().__init__(id="chat-list")
        self.chats = chats

    def compose(self) -> ComposeResult:
        with Vertical(id="chat-list-box"):
            yield Label("Saved chats (Enter opens, Escape goes back)", classes="title")
            if self.chats:
                yield OptionList(*[Option(chat_row(c), id=str(c.id)) for c in self.chats])
            else:
                yield Label("No saved chats yet.")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))


class ConfirmScreen(ModalScreen[bool]):
    """A question with Yes and No; y/n and Escape work too."""

    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str, yes: str = "Yes", no: str = "No"):
        super().__init__(id="confirm")
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-box"):
            yield Label(self.question, id="question")
            with Horizontal(id="confirm-buttons"):
                yield Button(self.yes, variant="primary", id="yes")
                yield Button(self.no, id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
