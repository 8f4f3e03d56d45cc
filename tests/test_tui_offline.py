"""Chat app behaviour that needs no model: reopening chats, export, keys remapped from
config.toml, prompt history, the command palette. The app never reaches a daemon here."""

from __future__ import annotations

import time

from tui_fixed import ANSWER, FixedChatApp, fixed_app

from localllm.tui.screens import ChatListScreen
from localllm.tui.widgets import Note, PromptInput


async def wait_until(pilot, predicate, what: str, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.02)  # ok-sleep: the poll interval of a deadline loop


def notes(app) -> list[str]:
    return [n.text for n in app.query(Note)]


async def test_resume_from_the_chat_list_and_export_markdown(home):
    app = fixed_app(home, resume="")  # `localllm run --resume` with no name: the list
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: isinstance(app.screen, ChatListScreen), "the list")
        await pilot.press("enter")
        await wait_until(pilot, lambda: len(app.chat.entries) == 2, "the chat to open")
        assert app.chat.entries[1].content == ANSWER and app.chat.options == {"temperature": 0.2}
        assert app.sub_title == "gemma3-27b · loops"
        target = home / "out" / "loops.md"
        app.prompt.load_text(f"/export {target}")
        await pilot.press("enter")
        await wait_until(pilot, target.exists, "the export")
        text = target.read_text()
        assert text.startswith("# loops") and "## You\n\nShow me a Python loop." in text
        assert "```python\nfor i in range(3):" in text and "temperature = 0.2" in text
        assert target.stat().st_mode & 0o777 == 0o600  # as private as the chats it came from


async def test_click_copies_a_code_block_or_the_whole_message(home):
    from textual.widgets._markdown import MarkdownFence

    app = fixed_app(home)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_until(pilot, lambda: app.query(MarkdownFence)
                         and app.query_one(MarkdownFence).region.height, "the code block")
        await pilot.click(MarkdownFence)
        assert app.clipboard == "for i in range(3):\n    print(i)"
        await pilot.click(".message.user")
        assert app.clipboard == "Show me a Python loop.\nKeep it short."


async def test_the_chat_follows_new_text_only_while_at_the_bottom(home):
    app = fixed_app(home)
    for i in range(12):
        app.store.add_message(app.store.find_chat("loops").id, "user", f"question {i}")
    async with app.run_test(size=(80, 24)) as pilot:
        log = app.log_view
        await wait_until(pilot, lambda: len(app.chat.entries) == 14 and log.max_scroll_y > 10,
                         "a chat longer than the screen")
        await wait_until(pilot, lambda: log.scroll_y == log.max_scroll_y, "the bottom")
        await pilot.press("pageup")
        await wait_until(pilot, lambda: log.scroll_y == log.scroll_target_y < log.max_scroll_y,
                         "scrolling up to end")
        where = log.scroll_y
        app.note("new text while the user reads above")
        await pilot.pause()
        assert log.scroll_y == where  # not dragged down
        for _ in range(5):
            await pilot.press("pagedown")
        await wait_until(pilot, lambda: log.scroll_y == log.max_scroll_y, "the bottom again")
        bottom = log.max_scroll_y
        app.note("more text\nover\nseveral lines")
        await wait_until(pilot, lambda: log.max_scroll_y > bottom
                         and log.scroll_y == log.max_scroll_y, "following new text")


async def test_save_clear_and_history(home):
    app = fixed_app(home, resume="loops")
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_until(pilot, lambda: len(app.chat.entries) == 2, "the chat to open")
        for line in ("/save sea stories", "/set system Answer in French.", "/clear"):
            app.prompt.load_text(line)
            await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat.chat_id is None and not app.chat.entries,
                         "a new chat")
        assert app.store.find_chat("sea stories").system == "Answer in French."
        assert app.chat.system == "Answer in French."  # a new chat keeps the session's settings
        app.prompt.load_text("draft")
        await pilot.press("up")  # Up recalls earlier lines, newest first, commands too
        assert app.prompt.text == "/clear"
        await pilot.press("up", "up", "up")
        assert app.prompt.text == "Show me a Python loop.\nKeep it short."  # from the database
        await pilot.press("up")  # on the second of two lines: the cursor moves, no recall
        assert app.prompt.text.startswith("Show me") and app.prompt.cursor_location[0] == 0
        await pilot.press("down", "down", "down", "down", "down")
        assert app.prompt.text == "draft"  # back to what was being typed
        app.prompt.load_text("/nope")
        await pilot.press("enter")
        await wait_until(pilot, lambda: any("unknown command" in n for n in notes(app)),
                         "an error note")


async def test_keys_are_remapped_from_config_toml(home):
    config_dir = home / "xdg_config_home" / "localllm"
    config_dir.mkdir(parents=True)
    (config_dir / "config.toml").write_text(
        'keep_alive = "5m"\n[keys]\nsend = "ctrl+j"\nnew_line = "enter"\nstop = "ctrl+x"\n'
        'bogus = "f1"\n')
    app = fixed_app(home, resume=None)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("a", "enter", "b", "ctrl+j")
        assert app.sent == ["a\nb"]
        assert any("bogus: unknown" in n for n in notes(app))
        await pilot.press("ctrl+c")  # no longer bound to stop: the prompt box copies
        assert app.is_running
        await pilot.press("ctrl+x", "ctrl+x")  # stop, pressed twice, quits
        await wait_until(pilot, lambda: not app.is_running, "the app to quit")


async def test_every_action_is_in_the_command_palette(home):
    app = fixed_app(home)
    async with app.run_test(size=(80, 24)) as pilot:
        app.models[:] = ["smollm2"]
        titles = {c.title for c in app.get_system_commands(app.screen)}
        for title in ("Stop the answer", "Regenerate", "New chat", "Open a saved chat",
                      "Export to Markdown", "Show plan", "Help: keys", "Load smollm2"):
            assert title in titles
        show_plan = next(c for c in app.get_system_commands(app.screen)
                         if c.title == "Show plan")
        show_plan.callback()
        await wait_until(pilot, lambda: any("40/63 layers on GPU" in n for n in notes(app)),
                         "the plan")
        assert isinstance(app.focused, PromptInput)


async def test_a_resumed_chat_shows_its_context_fill_at_once(home):
    """`run --resume` of a saved chat: the stats line reads the chat's context fill as the
    daemon measured it after the last answer, not `ctx 0`, before anything is sent."""
    from localllm.config import Config
    from localllm.tui.chatstore import ChatStore
    from localllm.tui.widgets import StatsLine

    class NotLoadedYet(FixedChatApp):
        def prepare(self, model: str, offer_pull: bool = True) -> None:
            self.sent = []  # the model is still loading: no turn, no runner figures

    store = ChatStore(home / "chats.db")
    chat = store.create_chat("smollm2")
    for i in range(3):
        store.add_message(chat, "user", f"question {i}")
        store.add_message(chat, "assistant", f"answer {i}", stats={
            "eval_count": 8, "eval_duration": 10**8, "context_used": 100 * (i + 1),
            "context_length": 4096})
    store.update_chat(chat, name="six")
    app = NotLoadedYet(Config(host="127.0.0.1:9", socket=str(home / "none.sock")), "smollm2",
                       store=store, resume="six")
    async with app.run_test(size=(100, 24)) as pilot:
        await wait_until(pilot, lambda: len(app.chat.entries) == 6, "the chat to open")
        await wait_until(pilot, lambda: "ctx" in str(app.query_one(StatsLine).render()),
                         "the stats line")
        line = str(app.query_one(StatsLine).render())
        assert line == "ctx 300/4096 7%", line


async def test_a_capped_num_ctx_is_named_in_the_ready_line(home):
    app = fixed_app(home, resume=None)
    async with app.run_test(size=(100, 24)):
        assert "context 8192 (plan" in app._loaded_text("gemma3-27b", 1.0)
        app.chat.options["num_ctx"] = 999999  # `localllm run --ctx 999999`
        assert "context 8192 (num_ctx 999999 was capped at 8192) (plan" in \
            app._loaded_text("gemma3-27b", 1.0)
