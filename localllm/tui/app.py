"""`localllm run`: the chat app. It talks to the daemon only through `localllm.client.Client`.

Layers: this App (layout, startup, the answer worker, the stats feed), conversation.py (the
chat it holds as `chat`: model, settings, turns and their saving, the messages the daemon gets),
actions.py (what the user can do: slash commands, keys, the command palette), widgets.py and
screens.py (what is drawn), slash.py and stats.py (parsing and formatting, pure), chatstore.py
(SQLite).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import aiohttp
from textual import work
from textual.app import App, ComposeResult
from textual.containers import VerticalScroll
from textual.reactive import reactive
from textual.widget import Widget
from textual.widgets import Footer, Header, Markdown, Static

from localllm.client import Client, DaemonError
from localllm.config import Config, config_file
from localllm.errors import UserError
from localllm.image_paths import attach_images
from localllm.repeats import LoopGuard

from . import keys
from .actions import ChatActions
from .chatstore import ChatStore
from .conversation import Conversation
from .slash import request_extra
from .startup import CONNECTION_ERRORS, Startup, lost_daemon_text, not_stored_hint
from .stats import DecodeRate, RunnerStats, Segment, TurnStats, answer_footer, answer_notes, \
    find_runner, segments
from .widgets import hard_breaks, Entry, MessageView, Note, ProgressLine, PromptInput, StatsLine

SAVE_EVERY_S = 1.0  # a streaming answer is written to the database this often
# Drawing costs the runner decode speed where the CPU is shared: ten draws a second look live.
RENDER_EVERY_S = 0.1


class ChatApp(ChatActions, App[int]):
    CSS_PATH = Path(__file__).with_name("chat.tcss")  # absolute: subclasses live elsewhere
    TITLE = "localllm"
    BINDINGS = keys.bindings("app")

    streaming: reactive[bool] = reactive(False)

    def __init__(self, config: Config, model: str, *, store: ChatStore,
                 resume: str | None = None):
        super().__init__()
        self.config = config
        self.store = store
        self.chat = Conversation(store, model, lambda text: self.note(text, "error"))
        self.resume = resume  # None: a new chat; "": pick from the list; else an id or name
        self.client = Client(config)
        self.startup = Startup(self)
        self.connected = False  # the daemon answered since the last lost connection
        self.rate = DecodeRate()
        self.runner: RunnerStats | None = None
        self.models: list[str] = []  # stored model names, for /load completion
        self.waiting_since = 0.0
        self.prompt_progress: tuple[int, int] | None = None  # prompt tokens read, of total
        self._quit_armed_until = 0.0
        self.keymap, self.key_warnings = keys.read_keymap(config_file())
        # The main screen's widgets, held here: a modal screen on top must not hide them.
        self.log_view = VerticalScroll(id="log")
        self.progress_line = ProgressLine(id="progress")
        self.stats_line = StatsLine()
        self.hint = Static("", id="hint", markup=False)
        self.prompt = PromptInput(self._history(), self.models, self.keymap)

    # ---- layout ----------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield self.log_view
        yield self.progress_line
        yield self.stats_line
        yield self.hint
        yield self.prompt
        yield Footer()

    def on_mount(self) -> None:
        self.set_keymap(self.keymap)
        theme = self.chat.safe(self.store.get_setting, "theme")
        if theme in self.available_themes:
            self.theme = theme
        self.theme_changed_signal.subscribe(
            self, lambda t: self.chat.safe(self.store.set_setting, "theme", t.name))
        self.log_view.anchor()  # follow new text while the user is at the bottom
        self.progress_line.stop()
        self.hint.display = False
        for warning in self.key_warnings:
            self.note(warning, "warning")
        self.set_interval(0.1, self.refresh_stats)
        self.set_interval(1.0, self.poll_runner)
        self._show_title()
        self.prompt.focus()
        if self.resume == "":
            self.action_open_chats()
        elif self.resume is not None:
            chat = self.chat.safe(self.store.find_chat, self.resume)
            if chat is None:
                self.note(f"No saved chat '{self.resume}'; /chats lists them.", "error")
            else:
                self.open_chat(chat.id, load=False)
        self.prepare(self.chat.model)

    async def on_unmount(self) -> None:
        await self.client.close()

    def _show_title(self) -> None:
        self.sub_title = self.chat.title()

    def _history(self) -> list[str]:
        try:
            return self.store.prompt_history()
        except sqlite3.Error:  # said once the chat is up, by the first save that fails
            return []

    # ---- notes and turns -------------------------------------------------------------------
    def note(self, text: str, kind: str = "info") -> Note:
        note = Note(text, kind)
        self.log_view.mount(note)
        return note

    def add_entry(self, role: str, content: str, state: str = "done",
                  mount: bool = True, images: tuple[str, ...] = ()) -> Entry:
        """A new turn of the chat, saved, with its view (mounted unless `mount` is false)."""
        who = self.chat.model if role == "assistant" else ""
        entry = self.chat.add(Entry(role, content, state, None,
                                    MessageView(role, content, who, "", state), images))
        if mount:
            self.log_view.mount(entry.view)
        return entry

    # ---- sending ---------------------------------------------------------------------------
    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        self._quit_armed_until = 0.0
        self.hint.display = False
        text = message.text
        if text.lstrip().startswith("/"):
            self.run_slash(text.strip())
            return
        if self.streaming:
            self.note("An answer is still streaming: wait for it, or press Ctrl+C to stop it.",
                      "warning")
            return
        text, images = attach_images(text)
        for image in images:
            self.note(image.line())
        self.add_entry("user", text, images=tuple(image.base64 for image in images))
        self._show_title()
        self.answer()

    def on_prompt_input_suggest(self, message: PromptInput.Suggest) -> None:
        self.hint.update("   ".join(message.candidates))
        self.hint.display = bool(message.candidates)

    @work(exclusive=True, group="answer")
    async def answer(self) -> None:
        messages = self.chat.request_messages()
        entry = self.add_entry("assistant", "", "streaming", mount=False)
        view = entry.view
        await self.log_view.mount(view)
        stream = Markdown.get_stream(view.markdown)
        self.streaming, self.chat.turn, self.waiting_since = True, None, time.monotonic()
        self.prompt_progress = None
        self.rate.reset()
        parts: list[str] = []
        state, last_save, finished = "error", time.monotonic(), False
        loops, looped, final = LoopGuard(), 0, {}
        unrendered: list[str] = []  # text not drawn yet: _finish draws the whole answer
        last_render = 0.0
        try:
            chunks = self.client.chat(self.chat.model, messages, self.chat.options or None,
                                      **request_extra(self.chat.format, self.chat.think))
            async with contextlib.aclosing(chunks):  # leaving it stops the model
                async for chunk in chunks:
                    self.connected, finished = True, chunk.done
                    final = chunk.data if chunk.done else final
                    self.chat.stored_name = chunk.data.get("model", self.chat.stored_name)
                    if chunk.text:
                        parts.append(chunk.text)
                        unrendered.append(chunk.text)
                        if time.monotonic() - last_render >= RENDER_EVERY_S:
                            await stream.write("".join(unrendered))
                            unrendered.clear()
                            last_render = time.monotonic()
                    if chunk.data.get("progress"):  # a long prompt is being read
                        self.prompt_progress = (chunk.data["progress"]["prompt_read"],
                                                chunk.data["progress"]["prompt_total"])
                    if chunk.data.get("stats"):
                        self.chat.turn = TurnStats.from_wire(chunk.data["stats"], chunk.done,
                                                        chunk.data.get("done_reason", ""))
                        self.rate.add(self.chat.turn.eval_count, self.chat.turn.eval_duration_ns)
                    if time.monotonic() - last_save > SAVE_EVERY_S and entry.db_id:
                        last_save = time.monotonic()
                        self.chat.safe(self.store.update_message, entry.db_id, "".join(parts),
                                   "streaming")
                    if not chunk.done and (looped := loops.feed(chunk.text)):
                        break
                    looped = looped or loops.ended(chunk.data if chunk.done else {})
            if not finished and not looped:  # the daemon went away between two lines
                raise aiohttp.ClientPayloadError("the stream ended before the answer did")
            state = "stopped" if looped else "done"
        except asyncio.CancelledError:
            state = "stopped"
            raise
        except DaemonError as e:
            self.note(self._explain(e), "error")
        except CONNECTION_ERRORS:
            self.connected = False
            await self.client.close()  # the next message reconnects (and starts the daemon)
            self.note(lost_daemon_text("mid-answer", "The chat is saved: send again to start "
                                       "the daemon and get the answer."), "error")
        finally:
            await self._finish(entry, stream, "".join(parts), state)
            for text, kind in answer_notes(final, looped, self.chat.verbose):
                self.note(text, kind)

    async def _finish(self, entry: Entry, stream, text: str, state: str) -> None:
        turn = self.chat.turn
        if turn is not None and state == "stopped":
            turn = self.chat.turn = replace(turn, done=True, done_reason="cancelled")
        entry.content, entry.state = text, state
        # first the database: this also runs when the app is closing; +who wrote it
        self.chat.save(entry, text, state, {**(turn.to_wire() if turn else {}),
                                            "model": self.chat.model})
        self.streaming = False
        footer = answer_footer(turn) if turn else ""
        if state == "error":
            footer = (footer + " · " if footer else "") + "failed"
        elif state == "stopped" and not turn:
            footer = "stopped"
        entry.view.finish(text, footer, state)
        await stream.stop()
        if entry.view.is_mounted:
            # one full render (streamed fences can lag), the model's line breaks kept
            await entry.view.markdown.update(hard_breaks(text))

    def _explain(self, error: DaemonError, model: str = "") -> str:
        if error.status == 404:
            return f"{error}: {not_stored_hint(model or self.chat.model, self.models)}"
        if 400 <= error.status < 500:
            return f"The daemon refused: {error}"
        return f"The answer failed: {error}"

    def stop_answer(self) -> bool:
        """Cancel the answer worker: closing its HTTP stream makes the daemon stop generating."""
        if not self.streaming:
            return False
        self.workers.cancel_group(self, "answer")
        return True

    # ---- startup: daemon, model, load (startup.py) ----------------------------------------
    @work(exclusive=True, group="prepare")
    async def prepare(self, model: str, offer_pull: bool = True) -> None:
        await self.startup.prepare(model, offer_pull)

    def _loaded_text(self, model: str, seconds: float) -> str:
        r = self.runner
        if r is None:
            return f"{model} is ready."
        where = "CPU only" if r.gpu_layers == 0 else f"{r.gpu_layers}/{r.layers} layers on GPU"
        asked = self.chat.options.get("num_ctx", 0)
        capped = f" (num_ctx {asked} was capped at {r.n_ctx})" if r.n_ctx < asked else ""
        return (f"{model} ready in {seconds:.1f} s: {where}, KV {r.kv_type}, context {r.n_ctx}"
                f"{capped} (plan: {r.plan_source or 'default'}; /show plan says why).")

    # ---- stats -----------------------------------------------------------------------------
    def refresh_stats(self) -> None:
        """Ten times a second: the stats line from the latest counters the daemon sent."""
        parts = segments(self.chat.turn, self.rate.rate, self.runner, self.streaming)
        if self.streaming and self.chat.turn is None:
            waited = time.monotonic() - self.waiting_since
            read = self.prompt_progress
            text = (f"reading the prompt: {read[0]:,}/{read[1]:,} tokens… {waited:.1f} s" if read
                    else f"waiting for the first token… {waited:.1f} s")
            parts = [Segment(text, 0)] + parts
        if self.stats_line.is_mounted:
            self.stats_line.show(parts)
            self._follow_if_at_bottom()

    def poll_runner(self) -> None:
        if self.connected:
            self._poll_worker()

    @work(exclusive=True, group="poll")
    async def _poll_worker(self) -> None:
        await self._poll_runner_once()

    async def _poll_runner_once(self) -> None:
        try:
            self.runner = find_runner(await self.client.stats(), self.chat.stored_name)
        except (DaemonError, *CONNECTION_ERRORS):
            self.runner = None

    def mount_views(self, views: Iterable[Widget]) -> None:
        self.log_view.mount_all(list(views))


async def run_chat(config: Config, model: str, resume: str | None = None,
                   options: dict | None = None) -> int:
    """The entry point of `localllm run` on a terminal: the chat until the user quits.

    resume: None starts a new chat, "" picks one from the list, else a chat's name or id.
    options: Ollama options for every request (`--ctx` gives num_ctx).
    """
    from .chatstore import default_path

    try:
        store = ChatStore()
    except sqlite3.Error as e:
        raise UserError(f"cannot open the chat database {default_path()}: {e}") from None
    app = ChatApp(config, model, store=store, resume=resume)
    app.chat.options.update(options or {})
    try:
        await app.run_async()
    finally:
        await app.client.close()
        store.close()
    if farewell := last_exchange(app.chat.entries):
        print(farewell)
    return app.return_code or 0


def last_exchange(entries: list) -> str:
    """The last question and its answer, printed when the chat closes: the full-screen chat
    leaves nothing in the terminal's scrollback otherwise (`ollama run` leaves it all)."""
    answer = next((i for i in range(len(entries) - 1, -1, -1)
                   if entries[i].role == "assistant" and entries[i].content), None)
    if answer is None:
        return ""
    question = next((e.content for e in reversed(entries[:answer]) if e.role == "user"), "")
    return (f">>> {question}\n" if question else "") + entries[answer].content.rstrip()
