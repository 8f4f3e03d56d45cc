"""What the chat looks like, pinned with pytest-textual-snapshot, from fixed data (no daemon).

Update after an intended change: pytest tests/test_tui_snapshots.py --snapshot-update,
then look at the SVGs in tests/__snapshots__/test_tui_snapshots/ before committing them.
"""

from __future__ import annotations

import pytest

from tui_fixed import fixed_app

from localllm.tui.stats import RunnerStats, TurnStats


@pytest.fixture
def app(home):
    return fixed_app(home)


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
        app.chat.turn = TurnStats(eval_count=57, eval_duration_ns=700_000_000,
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
