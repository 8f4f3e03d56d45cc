"""`localllm run` in a real terminal (tmux): type a prompt, read the answer and stats off the
screen. CI needs tmux installed (apt-get install tmux)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from scripts import tmux_run_check

from localllm.tui.chatstore import ChatStore

PROMPT = "Write a long story about a lighthouse."  # long: the 24 tokens are all there


@pytest.mark.parametrize("size", [(80, 24), (140, 40)])
def test_run_in_a_real_terminal_shows_the_answer_and_the_stats(daemon, size):
    # scripts/test.sh installs tmux; a missing tmux fails here rather than skipping.
    assert shutil.which("tmux"), "tmux is not installed: apt install tmux"
    env = {**daemon.env, "LOCALLLM_HOST": daemon.url.removeprefix("http://")}
    daemon.unload("smollm2")  # an earlier test's num_ctx must not be the context seen here
    seen = tmux_run_check.check("smollm2", PROMPT, env=env, width=size[0],
                                height=size[1], num_predict=24)
    assert "smollm2 ready in" in seen.ready_line and "context 4096" in seen.ready_line
    assert seen.answer, f"no answer on screen:\n{seen.screen}"
    assert seen.decode_tps > 0 and seen.answer_tokens == 24
    assert 24 < seen.context_used < seen.context_length == 4096
    assert seen.exited, f"/bye did not end the program:\n{seen.screen}"
    # The chat was saved where `localllm run --resume` finds it.
    store = ChatStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "chats.db")
    chat = store.chats()[0]
    assert [m.role for m in store.messages(chat.id)] == ["user", "assistant"]
    assert chat.title == PROMPT and chat.options == {"num_predict": 24, "temperature": 0.0}
    store.close()
