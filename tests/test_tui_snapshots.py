"""What the chat looks like, pinned with pytest-textual-snapshot, from fixed data (no daemon).

Update after an intended change: pytest tests/test_tui_snapshots.py --snapshot-update,
then look at the SVGs in tests/__snapshots__/test_tui_snapshots/ before committing them.
"""

from __future__ import annotations

import pytest

from localllm.config import Config
from localllm.tui.app import ChatApp
from localllm.tui.chatstore import ChatStore
from localllm.tui.stats import RunnerStats, TurnStats

ANSWER = ("Here is a loop:\n\n```python\nfor i in range(3):\n    print(i)\n```\n\n"
          "It prints **0**, **1** and **2**.")
TURN = TurnStats(eval_count=128, eval_duration_ns=1_600_000_000, prompt_eval_count=412,
                 prompt_eval_duration_ns=206_000_000, context_used=540, context_length=8192,
                 ttft_ns=231_000_000, done=True, done_reason="stop")
RUNNER = RunnerStats(pid=4242, rss_bytes=612 << 20, vram_bytes=9_900 << 20,
                     vram_estimated=False, gpu_layers=40, layers=63, kv_type="q8_0",
                     n_ctx=8192, plan_source="tuner")


class FixedChatApp(ChatApp):
    """The real app with the daemon's figures fixed: it never connects."""

    def prepare(self, model: str) -> None:
        self.runner, self.turn = RUNNER, TURN


@pytest.fixture
def app(home) -> FixedChatApp:
    store = ChatStore(home / "chats.db")
    chat = store.create_chat("gemma3-27b", options={"temperature": 0.2})
    store.add_message(chat, "user", "Show me a Python loop.\nKeep it short.")
    store.add_message(chat, "assistant", ANSWER, stats=TURN.to_wire())
    store.update_chat(chat, name="loops")
    # A port nothing listens on: a test that did connect would fail, not reach a daemon.
    return FixedChatApp(Config(host="127.0.0.1:9", socket=str(home / "none.sock")),
                        "gemma3-27b", store=store, resume="loops")


async def settle(pilot) -> None:
    pilot.app.refresh_stats()
    await pilot.pause()


def test_main_screen_80x24(app, snap_compare):
    assert snap_compare(app, terminal_size=(80, 24), run_before=settle)


def test_main_screen_wide_light(app, snap_compare):
    async def light(pilot):
        pilot.app.theme = "textual-light"
        await settle(pilot)

    assert snap_compare(app, terminal_size=(140, 36), run_before=light)


def test_stats_line_while_streaming(app, snap_compare):
    async def streaming(pilot):
        app = pilot.app
        app.streaming = True
        app.turn = TurnStats(eval_count=57, eval_duration_ns=700_000_000,
                             prompt_eval_count=412, prompt_eval_duration_ns=206_000_000,
                             context_used=1001, context_length=8192, ttft_ns=231_000_000,
                             drafted=60, draft_accepted=45)
        app.runner = RunnerStats(pid=1, rss_bytes=1 << 30, vram_bytes=10 << 30,
                                 vram_estimated=True, gpu_layers=63, layers=63, kv_type="f16",
                                 n_ctx=8192)
        for count, ns in ((40, 500_000_000), (57, 700_000_000)):
            app.rate.add(count, ns)
        await settle(pilot)

    assert snap_compare(app, terminal_size=(120, 24), run_before=streaming)


def test_command_completion_and_help(app, snap_compare):
    async def typing(pilot):
        pilot.app.prompt.load_text("/show p")
        await settle(pilot)

    assert snap_compare(app, terminal_size=(80, 24), run_before=typing)
