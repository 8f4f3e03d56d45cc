"""Chats saved as you go: SQLite in the data dir (chats.db), one row per chat and per message.

Each write is its own committed transaction, so a crash, a killed terminal or a daemon that
dies mid-answer loses nothing already shown: an answer is stored when it starts and updated
while it streams.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from localllm import paths

SCHEMA_VERSION = 1
SCHEMA = """
CREATE TABLE IF NOT EXISTS chat (
    id INTEGER PRIMARY KEY,
    name TEXT NOT NULL DEFAULT '',        -- set by /save NAME
    model TEXT NOT NULL,
    system TEXT NOT NULL DEFAULT '',
    options TEXT NOT NULL DEFAULT '{}',   -- JSON: the /set parameter values
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS message (
    id INTEGER PRIMARY KEY,
    chat_id INTEGER NOT NULL REFERENCES chat(id) ON DELETE CASCADE,
    role TEXT NOT NULL,                   -- user, assistant, system
    content TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'done',   -- done, streaming, stopped, error
    stats TEXT,                           -- JSON: the daemon's counters for an answer
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS message_chat ON message(chat_id, id);
-- the images a user turn sent (base64, as the API takes them): a reopened chat sends them again
CREATE TABLE IF NOT EXISTS image (
    id INTEGER PRIMARY KEY,
    message_id INTEGER NOT NULL REFERENCES message(id) ON DELETE CASCADE,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS image_message ON image(message_id, id);
CREATE TABLE IF NOT EXISTS setting (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


def default_path() -> Path:
    return paths.data_dir() / "chats.db"


@dataclass(frozen=True)
class ChatInfo:
    id: int
    name: str
    model: str
    system: str
    options: dict
    created_at: float
    updated_at: float
    title: str  # the name, else the start of the first prompt
    n_messages: int


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: str
    content: str
    state: str = "done"
    stats: dict | None = None
    images: tuple[str, ...] = ()  # base64


class NewerSchema(sqlite3.DatabaseError):
    """The database was written by a newer localllm: kept as it is, the chat refuses it."""


class ChatStore:
    def __init__(self, path: Path | None = None):
        self.path = path or default_path()
        # Every conversation is in here: the user's alone, as the store is. SQLite gives its
        # -wal and -shm files the database's mode.
        paths.private_dir(self.path.parent)
        try:
            self._open()
        except NewerSchema:
            raise
        except sqlite3.DatabaseError as e:  # not a database, or a damaged one: set aside
            if getattr(self, "db", None) is not None:
                self.db.close()
            for extra in ("-wal", "-shm"):
                self.path.with_name(self.path.name + extra).unlink(missing_ok=True)
            paths.set_aside(self.path, "the chat database", e)
            self._open()

    def _open(self) -> None:
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(self.path, 0o600)
        self.db = sqlite3.connect(self.path, isolation_level=None)  # autocommit: saved at once
        self.db.execute("PRAGMA foreign_keys = ON")
        self.db.execute("PRAGMA journal_mode = WAL")
        version = self.db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise NewerSchema(f"{self.path} is from a newer localllm "
                              f"(schema {version}); upgrade localllm to open it")
        self.db.executescript(SCHEMA)
        self.db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        self.db.execute("SELECT count(*) FROM chat").fetchone()  # a damaged file fails here

    def close(self) -> None:
        self.db.close()

    # ---- chats ---------------------------------------------------------------------------
    def create_chat(self, model: str, system: str = "", options: dict | None = None) -> int:
        now = time.time()
        cur = self.db.execute(
            "INSERT INTO chat (model, system, options, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?)", (model, system, json.dumps(options or {}), now, now))
        return int(cur.lastrowid)

    def update_chat(self, chat_id: int, **fields) -> None:
        allowed = {"name", "model", "system", "options"}
        if not fields.keys() <= allowed:
            raise ValueError(f"cannot update {set(fields) - allowed}")
        if "options" in fields:
            fields["options"] = json.dumps(fields["options"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE chat SET {sets}, updated_at = ? WHERE id = ?",
                        (*fields.values(), time.time(), chat_id))

    def chats(self, limit: int = 200) -> list[ChatInfo]:
        rows = self.db.execute(
            "SELECT c.id, c.name, c.model, c.system, c.options, c.created_at, c.updated_at, "
            "(SELECT content FROM message m WHERE m.chat_id = c.id AND m.role = 'user' "
            " ORDER BY m.id LIMIT 1), "
            "(SELECT COUNT(*) FROM message m WHERE m.chat_id = c.id) "
            "FROM chat c ORDER BY c.updated_at DESC, c.id DESC LIMIT ?", (limit,)).fetchall()
        return [_chat(row) for row in rows]

    def get_chat(self, chat_id: int) -> ChatInfo | None:
        return next((c for c in self.chats(limit=-1) if c.id == chat_id), None)

    def find_chat(self, ref: str) -> ChatInfo | None:
        """A chat by its id or its /save name; the latest one for ''."""
        chats = self.chats(limit=-1)
        if not ref:
            return chats[0] if chats else None
        if ref.isdigit():
            found = next((c for c in chats if c.id == int(ref)), None)
            if found:
                return found
        return next((c for c in chats if c.name == ref), None)

    def delete_chat(self, chat_id: int) -> None:
        self.db.execute("DELETE FROM chat WHERE id = ?", (chat_id,))

    # ---- messages ------------------------------------------------------------------------
    def add_message(self, chat_id: int, role: str, content: str, state: str = "done",
                    stats: dict | None = None, images: tuple[str, ...] = ()) -> int:
        now = time.time()
        with self.db:  # the message and its images together
            self.db.execute("BEGIN")
            cur = self.db.execute(
                "INSERT INTO message (chat_id, role, content, state, stats, created_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (chat_id, role, content, state, json.dumps(stats) if stats else None, now))
            message_id = int(cur.lastrowid)
            self.db.executemany("INSERT INTO image (message_id, data) VALUES (?, ?)",
                                [(message_id, data) for data in images])
            self.db.execute("UPDATE chat SET updated_at = ? WHERE id = ?", (now, chat_id))
        return message_id

    def update_message(self, message_id: int, content: str, state: str,
                       stats: dict | None = None) -> None:
        self.db.execute("UPDATE message SET content = ?, state = ?, stats = ? WHERE id = ?",
                        (content, state, json.dumps(stats) if stats else None, message_id))

    def delete_message(self, message_id: int) -> None:
        self.db.execute("DELETE FROM message WHERE id = ?", (message_id,))

    def messages(self, chat_id: int) -> list[StoredMessage]:
        rows = self.db.execute("SELECT id, role, content, state, stats FROM message "
                               "WHERE chat_id = ? ORDER BY id", (chat_id,)).fetchall()
        images: dict[int, list[str]] = {}
        for message_id, data in self.db.execute(
                "SELECT i.message_id, i.data FROM image i JOIN message m ON m.id = i.message_id "
                "WHERE m.chat_id = ? ORDER BY i.id", (chat_id,)):
            images.setdefault(message_id, []).append(data)
        return [StoredMessage(r[0], r[1], r[2], r[3], json.loads(r[4]) if r[4] else None,
                              tuple(images.get(r[0], ()))) for r in rows]

    def prompt_history(self, limit: int = 200) -> list[str]:
        """The user's latest prompts, oldest first, for Up/Down recall across chats."""
        rows = self.db.execute("SELECT content FROM message WHERE role = 'user' "
                               "ORDER BY id DESC LIMIT ?", (limit,)).fetchall()
        return [r[0] for r in reversed(rows)]

    # ---- settings (the theme) ------------------------------------------------------------
    def get_setting(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM setting WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set_setting(self, key: str, value: str) -> None:
        self.db.execute("INSERT INTO setting (key, value) VALUES (?, ?) "
                        "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, value))


def _chat(row) -> ChatInfo:
    chat_id, name, model, system, options, created, updated, first_prompt, count = row
    title = name or " ".join((first_prompt or "(empty chat)").split())[:60]
    return ChatInfo(chat_id, name, model, system, json.loads(options), created, updated, title,
                    count)


def chat_markdown(chat: ChatInfo, messages: list[StoredMessage]) -> str:
    """A chat as a Markdown document: what /export writes."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(chat.created_at))
    lines = [f"# {chat.title}", "", f"*{chat.model}, {when}*", ""]
    if chat.system:
        lines += ["## System", "", chat.system, ""]
    if chat.options:
        opts = ", ".join(f"{k} = {v}" for k, v in chat.options.items())
        lines += [f"*Parameters: {opts}*", ""]
    for message in messages:
        wrote = (message.stats or {}).get("model") or chat.model  # after a /load: that model
        who = {"user": "You", "assistant": wrote}.get(message.role, message.role.title())
        note = {"stopped": " (stopped)", "error": " (error)"}.get(message.state, "")
        lines += [f"## {who}{note}", "", message.content.rstrip(), ""]
    return "\n".join(lines)
