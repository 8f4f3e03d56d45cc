"""The chat app asked to pull from a hub that cannot be reached: one clear note, no traceback,
the app still running and the store untouched."""

from __future__ import annotations

from pathlib import Path

from daemon_process import isolated_env, start_daemon
from test_tui_app import chats, config_for, notes, wait_until  # noqa: F401 (chats: a fixture)

from localllm.modelstore.store import ModelStore
from localllm.tui.app import ChatApp


async def test_a_pull_from_an_unreachable_hub_is_one_clear_note(tmp_path, chats):  # noqa: F811
    from localllm.tui.screens import ConfirmScreen
    from localllm.tui.widgets import ProgressLine

    env = isolated_env(tmp_path / "d", LOCALLLM_HF_ENDPOINT="http://127.0.0.1:9")
    daemon = start_daemon(env)
    try:
        app = ChatApp(config_for(daemon), "hf.co/test/SmolLM2-GGUF:Q4_1", store=chats)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen),
                             "the offer to pull")
            await pilot.press("y")
            await wait_until(pilot, lambda: notes(app, "error"), "the error note")
            [note] = notes(app, "error")
            assert "cannot reach 127.0.0.1:9" in note and "LOCALLLM_HF_ENDPOINT" in note
            assert "Traceback" not in note
            assert not app.query_one(ProgressLine).display
            assert app.is_running
        store = ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")
        assert store.list() == []
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()
