"""A chat app with the daemon's figures fixed, for snapshot and offline tests: it never
connects (its config points at a port and a socket nothing listens on)."""

from __future__ import annotations

from pathlib import Path

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
    sent: list[str]

    def prepare(self, model: str, offer_pull: bool = True) -> None:
        self.runner, self.chat.turn, self.sent = RUNNER, TURN, []

    def answer(self) -> None:  # what would be asked of the daemon
        self.sent.append(self.chat.request_messages()[-1]["content"])


def saved_chat(store: ChatStore, name: str = "loops") -> int:
    chat = store.create_chat("gemma3-27b", options={"temperature": 0.2})
    store.add_message(chat, "user", "Show me a Python loop.\nKeep it short.")
    store.add_message(chat, "assistant", ANSWER, stats=TURN.to_wire())
    store.update_chat(chat, name=name)
    return chat


def fixed_app(home: Path, resume: str | None = "loops") -> FixedChatApp:
    store = ChatStore(home / "chats.db")
    saved_chat(store)
    return FixedChatApp(Config(host="127.0.0.1:9", socket=str(home / "none.sock")),
                        "gemma3-27b", store=store, resume=resume)
