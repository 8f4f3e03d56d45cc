"""Key bindings of the chat, by id, and the user's remapping from config.toml's [keys] table:

    [keys]
    stop = "ctrl+c,escape"
    new_line = "shift+enter,ctrl+j,alt+enter"

Ids are Textual binding ids (App.set_keymap); values are Textual key names, comma-separated.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from textual.binding import Binding

# id -> (default keys, action, what it does). Owners: "app" or "input" (the prompt box).
KEYS: dict[str, tuple[str, str, str, str]] = {
    "send": ("enter", "submit", "send", "input"),
    "new_line": ("shift+enter,ctrl+j", "new_line", "new line", "input"),
    "complete": ("tab", "complete", "complete", "input"),
    "stop": ("ctrl+c", "stop_or_quit", "stop", "app"),
    "quit": ("ctrl+d", "quit_if_empty", "quit", "app"),
    "chats": ("ctrl+o", "open_chats", "chats", "app"),
    "new_chat": ("ctrl+n", "new_chat", "new chat", "app"),
    "regen": ("ctrl+r", "regen", "regenerate", "app"),
    "export": ("ctrl+s", "export", "export", "app"),
    "scroll_up": ("pageup", "scroll_log(-1)", "scroll up", "app"),
    "scroll_down": ("pagedown", "scroll_log(1)", "scroll down", "app"),
}

SHOWN_IN_FOOTER = {"send", "stop", "chats", "new_chat"}

_KEY_NAME = re.compile(r"^[a-z0-9_+\-]+$")


def bindings(owner: str) -> list[Binding]:
    """The Textual bindings for one owner. The app's are priority bindings, so the prompt box
    cannot swallow them; the prompt box's own keys are dispatched by `input_actions` instead,
    in order with the typed text (a priority binding would run before text typed ahead of it
    has reached the box)."""
    return [Binding(keys, action, description, id=binding_id, priority=owner == "app",
                    show=binding_id in SHOWN_IN_FOOTER)
            for binding_id, (keys, action, description, who) in KEYS.items() if who == owner]


def input_actions(keymap: dict[str, str]) -> dict[str, str]:
    """Key -> action of the prompt box, with the user's remapping applied."""
    actions = {}
    for binding_id, (default, action, _, owner) in KEYS.items():
        if owner == "input":
            for key in (keymap.get(binding_id) or default).split(","):
                actions[key.strip()] = action
    return actions


def read_keymap(config_path: Path) -> tuple[dict[str, str], list[str]]:
    """The [keys] table of config.toml as a keymap, and a warning for each entry it skips."""
    try:
        doc = tomllib.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        return {}, [f"{config_path}: {e}; using the default keys"]
    return parse_keymap(doc.get("keys", {}))


def parse_keymap(table: object) -> tuple[dict[str, str], list[str]]:
    if not isinstance(table, dict):
        return {}, ["[keys] in config.toml must be a table of id = \"keys\""]
    keymap: dict[str, str] = {}
    warnings: list[str] = []
    for binding_id, keys in table.items():
        if binding_id not in KEYS:
            warnings.append(f"[keys] {binding_id}: unknown; known: {', '.join(KEYS)}")
        elif not isinstance(keys, str) or not keys.strip():
            warnings.append(f"[keys] {binding_id}: must be a string such as \"ctrl+x\"")
        elif not all(_KEY_NAME.match(k.strip()) for k in keys.split(",")):
            warnings.append(f"[keys] {binding_id}: {keys!r} is not a list of key names")
        else:
            keymap[binding_id] = ",".join(k.strip() for k in keys.split(","))
    return keymap, warnings


def describe(keymap: dict[str, str]) -> str:
    """The `/? keys` text: every action, its id and the keys that do it now."""
    rows = [(i, (keymap.get(i) or keys).replace(",", ", "), what)
            for i, (keys, _, what, _) in KEYS.items()]
    rows += [("", "up, down", "earlier or later prompts (from the first or last line)"),
             ("", '"""', "begin or end a multi-line message"),
             ("", "ctrl+p", "command palette"),
             ("", "click", "copy a message (on a code block: just the code)")]
    return "Keys (remap them in config.toml under [keys] by id):\n" + \
        "\n".join(f"  {i:<9} {keys:<22} {what}" for i, keys, what in rows)
