"""The chat being had, apart from how it is drawn: its model and settings, its turns and their
rows in the chat store, the messages the daemon gets, and the figures of its last answer. The
App (app.py) holds one and draws it; slash commands (actions.py) change it through its methods.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from .chatstore import ChatInfo, ChatStore, StoredMessage
from .stats import TurnStats
from .widgets import Entry


def resumed_context(messages) -> TurnStats | None:
    """The context fill of a reopened chat, as the daemon measured it after the last answer
    that has figures: the stats line shows it until the next answer (not `ctx 0`)."""
    for m in reversed(messages):
        if m.stats and m.stats.get("context_used"):
            return TurnStats(context_used=int(m.stats["context_used"]),
                             context_length=int(m.stats.get("context_length", 0)), done=True)
    return None


class Conversation:
    """One chat: saved in `store` from its first turn on. A database failure never takes the
    chat down: `on_save_error` hears the first one, and the chat goes on unsaved."""

    def __init__(self, store: ChatStore, model: str,
                 on_save_error: Callable[[str], None] = lambda text: None):
        self.store = store
        self.model = model
        self.stored_name = model  # the daemon's name for it ('smollm2' -> 'smollm2:latest')
        self.chat_id: int | None = None
        self.system = ""
        self.options: dict = {}
        self.verbose = False  # /set verbose: timings after each answer
        self.format = ""  # /set format json
        self.think: bool | None = None  # /set think, /set nothink; None: the model's way
        self.entries: list[Entry] = []
        self.turn: TurnStats | None = None  # the latest answer's figures, as the daemon sent
        self._on_save_error = on_save_error
        self._save_failed = False

    # ---- the store -------------------------------------------------------------------------
    def safe(self, call, *args, **kwargs):
        """A database call that must not take the chat down: on failure, say so once."""
        try:
            return call(*args, **kwargs)
        except sqlite3.Error as e:
            if not self._save_failed:
                self._save_failed = True
                self._on_save_error(f"Cannot save the chat in {self.store.path}: {e}")
            return None

    def saved_id(self) -> int | None:
        """The chat's row, made on first need with the settings it has then."""
        if self.chat_id is None:
            self.chat_id = self.safe(self.store.create_chat, self.model, self.system,
                                     self.options)
        return self.chat_id

    def info(self) -> ChatInfo | None:
        return self.safe(self.store.get_chat, self.chat_id) if self.chat_id else None

    def title(self) -> str:
        chat = self.info()
        return f"{self.model} · {chat.title}" if chat else self.model

    # ---- turns -----------------------------------------------------------------------------
    def add(self, entry: Entry, stats: dict | None = None) -> Entry:
        """A new turn, saved (its row id on the entry)."""
        chat_id = self.saved_id()
        entry.db_id = self.safe(self.store.add_message, chat_id, entry.role, entry.content,
                                entry.state, stats, entry.images) if chat_id else None
        self.entries.append(entry)
        return entry

    def save(self, entry: Entry, text: str, state: str, stats: dict | None = None) -> None:
        """The entry's row as `text` in `state`: a streaming answer's so far, or its end (with
        the answer's figures)."""
        if entry.db_id:
            self.safe(self.store.update_message, entry.db_id, text, state, stats)

    def drop_last_answers(self) -> list[Entry]:
        """The answers at the end, taken out (and out of the store): to ask again."""
        dropped = []
        while self.entries and self.entries[-1].role == "assistant":
            entry = self.entries.pop()
            if entry.db_id:
                self.safe(self.store.delete_message, entry.db_id)
            dropped.append(entry)
        return dropped

    def request_messages(self) -> list[dict]:
        """The conversation as the daemon gets it: system message, then every non-empty turn."""
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages += [{"role": e.role, "content": e.content,
                      **({"images": list(e.images)} if e.images else {})}
                     for e in self.entries
                     if e.role in ("user", "assistant") and (e.content or e.images)
                     and e.state != "error"]
        return messages

    # ---- settings --------------------------------------------------------------------------
    def set_option(self, name: str, value) -> None:
        self.options[name] = value
        self._save_options()

    def unset_option(self, name: str) -> None:
        self.options.pop(name, None)
        self._save_options()

    def _save_options(self) -> None:
        if self.chat_id:
            self.safe(self.store.update_chat, self.chat_id, options=self.options)

    def set_system(self, text: str) -> None:
        self.system = text
        if self.chat_id:
            self.safe(self.store.update_chat, self.chat_id, system=text)

    def use_model(self, model: str) -> None:
        self.model = self.stored_name = model
        if self.chat_id:
            self.safe(self.store.update_chat, self.chat_id, model=model)

    def rename(self, name: str) -> bool:
        chat_id = self.saved_id()
        if chat_id is None:
            return False
        self.safe(self.store.update_chat, chat_id, name=name)
        return True

    # ---- whole chats -----------------------------------------------------------------------
    def clear(self) -> None:
        """A new chat with the same model and settings; the last one stays saved."""
        self.chat_id, self.turn = None, None
        self.entries.clear()

    def reopen(self, chat_id: int) -> tuple[ChatInfo, list[StoredMessage]] | None:
        """The saved chat's settings taken on and its rows read (None: it cannot be read); the
        caller makes its entries."""
        chat = self.safe(self.store.get_chat, chat_id)
        messages = self.safe(self.store.messages, chat_id)
        if chat is None or messages is None:
            return None
        self.chat_id, self.system, self.options = chat.id, chat.system, dict(chat.options)
        self.entries.clear()
        self.turn = resumed_context(messages)
        return chat, messages
