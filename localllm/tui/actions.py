"""What the user can do: slash commands, keys and the command palette. Mixed into ChatApp
(app.py): each changes the chat through the App's `chat` (conversation.py: settings, turns,
their saving) and then what is drawn."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from pathlib import Path

from textual import work
from textual.app import SystemCommand
from textual.screen import Screen

from localllm import paths
from localllm.client import DaemonError
from localllm.errors import UserError
from localllm.options import reloads

from . import keys
from .chatstore import chat_markdown
from .slash import Command, SlashError, help_text, parse, show_text
from .stats import TurnStats, answer_footer
from .widgets import Entry, MessageView

QUIT_WINDOW_S = 3.0  # a second Ctrl+C within this long quits


class ChatActions:
    """Slash commands (`run_slash(line)` is the one way in), key actions and palette entries.
    Keys and palette entries run slash commands, so every action is also a command."""

    def run_slash(self, line: str) -> None:
        try:
            command = parse(line)
        except SlashError as e:
            self.note(str(e), "error")
            return
        handler = getattr(self, "_cmd_" + command.name.replace(" ", "_"))
        handler(command)

    # ---- settings --------------------------------------------------------------------------
    def _cmd_set_parameter(self, command: Command) -> None:
        name, value = command.args
        self.chat.set_option(name, value)
        shown = " ".join(value) if isinstance(value, list) else value
        when = " (the model reloads with the next answer)" if reloads(name, value) else ""
        self.note(f"Set parameter '{name}' to '{shown}'{when}.")

    def _cmd_unset_parameter(self, command: Command) -> None:
        name = command.args[0]
        self.chat.unset_option(name)
        self.note(f"Parameter '{name}' is back to its default.")

    def _cmd_set_system(self, command: Command) -> None:
        self.chat.set_system(command.args[0])
        self.note("Set system message." if self.chat.system else "Cleared the system message.")

    def _cmd_set_verbose(self, command: Command) -> None:
        self.chat.verbose = command.args[0]
        self.note("Set 'verbose' mode: timings after each answer." if self.chat.verbose
                  else "Set 'quiet' mode.")

    def _cmd_set_format(self, command: Command) -> None:
        self.chat.format = command.args[0]
        self.note("Set format to 'json' mode." if self.chat.format else "Disabled format.")

    def _cmd_set_think(self, command: Command) -> None:
        self.chat.think = command.args[0]
        self.note("Set 'think' mode." if self.chat.think else "Set 'nothink' mode.")

    # ---- show ------------------------------------------------------------------------------
    def _cmd_show(self, command: Command) -> None:
        what = command.args[0]
        if what == "plan":
            self._show_plan()
        else:
            self._show_from_daemon(what)

    def _show_plan(self) -> None:
        r, model = self.runner, self.chat.model
        if r is None:
            self.note(f"{model} is not loaded right now; the plan is chosen when it loads.")
            return
        lines = [f"Plan for {model} (source: {r.plan_source}): {r.gpu_layers}/{r.layers} "
                 f"layers on GPU, KV {r.kv_type}, context {r.n_ctx}, runner pid {r.pid}"]
        lines += [f"  - {reason}" for reason in r.reasons]
        self.note("\n".join(lines))

    @work(group="show")
    async def _show_from_daemon(self, what: str) -> None:
        try:
            data = await self.client.request("POST", "/api/show", {"model": self.chat.model})
        except (DaemonError, UserError, OSError) as e:
            if what not in ("parameters", "system"):  # those the chat has set, at least
                self.note(f"Cannot show {what}: {e}", "error")
                return
            data = {}
        # parameters and system: the model's own (its Modelfile), under what this chat set
        self.note(show_text(what, data, self.chat.model, self.chat.options, self.chat.system))

    # ---- chats -----------------------------------------------------------------------------
    def _cmd_clear(self, command: Command) -> None:
        if self.streaming:
            self.note("Stop the answer first (Ctrl+C).", "warning")
            return
        self.chat.clear()
        self.log_view.remove_children()
        self._show_title()
        self.note("New chat. The last one is saved: /chats reopens it.")

    def _cmd_chats(self, command: Command) -> None:
        self.action_open_chats()

    def open_chat(self, chat_id: int, load: bool = True) -> None:
        if self.streaming:
            self.note("Stop the answer first (Ctrl+C).", "warning")
            return
        opened = self.chat.reopen(chat_id)
        if opened is None:
            self.note(f"Cannot open chat {chat_id}.", "error")
            return
        chat, messages = opened
        self.log_view.remove_children()
        for m in messages:
            footer = answer_footer(TurnStats.from_wire(m.stats, True,
                                                       m.stats.get("done_reason", ""))) \
                if m.stats else ""
            if m.state == "streaming":  # the app ended while this answer streamed
                m_state, footer = "stopped", footer or "interrupted"
            else:
                m_state = m.state
            # each answer under the model that wrote it (stored with its figures since /load
            # could change it mid-chat); the chat's model only for answers saved before that
            wrote = (m.stats or {}).get("model") or chat.model
            view = MessageView(m.role, m.content, wrote if m.role == "assistant" else "",
                               footer, m_state)
            self.chat.entries.append(Entry(m.role, m.content, m_state, m.id, view, m.images))
        self.mount_views(e.view for e in self.chat.entries)
        self.note(f"Reopened '{chat.title}' ({len(messages)} messages, {chat.model}).")
        if chat.model != self.chat.model:
            self.chat.model = chat.model
            if load:
                self.prepare(self.chat.model)
        self._show_title()

    def _cmd_save(self, command: Command) -> None:
        name = command.args[0]
        if name.isdigit():
            self.note("A chat name needs a letter (numbers are chat ids).", "error")
            return
        if not self.chat.rename(name):
            return
        self._show_title()
        self.note(f"Saved as '{name}': reopen it with `localllm run --resume {name}`.")

    def _cmd_export(self, command: Command) -> None:
        chat = self.chat.info()
        if chat is None:
            self.note("Nothing to export yet.", "warning")
            return
        if command.args:
            path = Path(command.args[0]).expanduser()
        else:
            slug = re.sub(r"[^A-Za-z0-9]+", "-", chat.title).strip("-")[:40] or "chat"
            path = paths.data_dir() / "exports" / f"{chat.id}-{slug}.md"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # 0600 as the chats database it comes from: a chat is the user's own to share
            paths.write_private(path, chat_markdown(
                chat, self.chat.safe(self.store.messages, chat.id) or []).encode())
        except OSError as e:
            self.note(f"Cannot write {path}: {e.strerror or e}", "error")
            return
        self.note(f"Exported to {path}")

    # ---- answers ---------------------------------------------------------------------------
    def _cmd_regen(self, command: Command) -> None:
        if self.streaming:
            self.note("Stop the answer first (Ctrl+C).", "warning")
            return
        for entry in self.chat.drop_last_answers():
            entry.view.remove()
        if not self.chat.entries:
            self.note("Nothing to answer again yet.", "warning")
            return
        self.answer()

    def _cmd_stop(self, command: Command) -> None:
        if not self.stop_answer():
            self.note("No answer is streaming.", "warning")

    def _cmd_load(self, command: Command) -> None:
        if self.streaming:
            self.note("Stop the answer first (Ctrl+C).", "warning")
            return
        # Switches to it once it is known to be stored; a missing one is named, never asked
        # about: a question would take the keys typed on after the command.
        self.prepare(command.args[0], offer_pull=False)

    def switch_model(self, model: str) -> None:
        if model == self.chat.model:
            return
        self.chat.use_model(model)
        self.runner = None
        self._show_title()

    # ---- help and quitting -----------------------------------------------------------------
    def _cmd_help(self, command: Command) -> None:
        topic = command.args[0] if command.args else ""
        self.note(keys.describe(self.keymap) if topic in ("keys", "shortcuts")
                  else help_text(topic))

    def _cmd_bye(self, command: Command) -> None:
        self.exit(0)

    # ---- keys ------------------------------------------------------------------------------
    def action_stop_or_quit(self) -> None:
        now = time.monotonic()
        if self.stop_answer():
            # A Ctrl+C that stops an answer does not count toward quitting: pressed twice by
            # reflex (as in `ollama run`), the second one only arms the quit.
            self._quit_armed_until = 0.0
            self.notify("Stopped.", timeout=QUIT_WINDOW_S)
        elif now < self._quit_armed_until:
            self.exit(0)
        else:
            self._quit_armed_until = now + QUIT_WINDOW_S
            self.notify("Press Ctrl+C again (or Ctrl+D) to quit.", timeout=QUIT_WINDOW_S)

    def action_quit_if_empty(self) -> None:
        if self.prompt.text:
            self.prompt.action_delete_right()
        else:
            self.exit(0)

    def action_scroll_log(self, pages: int) -> None:
        """Page through the chat; scrolling up stops following new text until the bottom."""
        log = self.log_view
        if pages < 0:
            log.scroll_page_up()
        elif log.scroll_y + log.scrollable_content_region.height >= log.max_scroll_y:
            log.scroll_end(animate=False)  # at the bottom: follow new text again
        else:
            log.scroll_page_down()

    def _follow_if_at_bottom(self) -> None:
        # Any scroll (a wheel turn at the very bottom too) lets go of the anchor, and Textual
        # only takes it back when the position changes: a reader who is at the bottom follows.
        log = self.log_view
        at_bottom = log.scroll_y >= log.max_scroll_y and log.scroll_target_y >= log.max_scroll_y
        if log.is_mounted and log.max_scroll_y and at_bottom:  # and not on the way up
            log.scroll_end(animate=False, immediate=True)

    def action_open_chats(self) -> None:
        from .screens import ChatListScreen

        chats = self.chat.safe(self.store.chats) or []

        def opened(chat_id: int | None) -> None:
            if chat_id is not None:
                self.open_chat(chat_id)

        self.push_screen(ChatListScreen(chats), opened)

    def action_new_chat(self) -> None:
        self.run_slash("/clear")

    def action_regen(self) -> None:
        self.run_slash("/regen")

    def action_export(self) -> None:
        self.run_slash("/export")

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        commands = [
            ("Stop the answer", "Stop generating (Ctrl+C)", "/stop"),
            ("Regenerate", "Answer the last prompt again", "/regen"),
            ("New chat", "Start a new chat; this one stays saved", "/clear"),
            ("Open a saved chat", "List saved chats", "/chats"),
            ("Export to Markdown", "Write this chat as a Markdown file", "/export"),
            ("Show model info", "Architecture, size, context", "/show info"),
            ("Show parameters", "The options this chat sends", "/show parameters"),
            ("Show template", "The model's chat template", "/show template"),
            ("Show plan", "How the model was loaded on this machine, and why", "/show plan"),
            ("Help: commands", "Slash commands", "/?"),
            ("Help: keys", "Key bindings and how to remap them", "/? keys"),
        ]
        for title, what, line in commands:
            yield SystemCommand(title, what, lambda line=line: self.run_slash(line))
        for model in self.models:
            yield SystemCommand(f"Load {model}", f"Chat with {model}",
                                lambda m=model: self.run_slash(f"/load {m}"), discover=False)
