"""The chat keeps the model's line breaks (a poem or a one-item-a-line list is not joined into
one paragraph), and /export names the model that wrote each answer after a /load."""

from __future__ import annotations

from textual.app import App
from textual.widgets._markdown import MarkdownParagraph

from localllm.tui.chatstore import ChatStore, chat_markdown
from localllm.tui.widgets import MessageView, hard_breaks

POEM = "Roses are red,\nviolets are blue.\n\n```\ncode line\nnext\n```\nafter"


class OneMessage(App):
    def compose(self):
        yield MessageView("assistant", POEM)


async def test_an_answers_single_line_breaks_are_drawn_as_line_breaks():
    app = OneMessage()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        paragraphs = [str(p._content) for p in app.query_one(MessageView).markdown.query(
            MarkdownParagraph)]
    assert "Roses are red,\nviolets are blue." in paragraphs
    assert "code line\nnext\n" in hard_breaks(POEM)  # code kept as it is


def test_export_names_the_model_that_wrote_each_answer(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("smollm2")
    store.add_message(chat, "user", "hi")
    first = store.add_message(chat, "assistant", "hello", stats={"model": "smollm2"})
    store.update_chat(chat, model="gemma3-270m")  # /load of another model
    store.add_message(chat, "user", "and you?")
    store.add_message(chat, "assistant", "fine", stats={"model": "gemma3-270m"})
    info = store.get_chat(chat)
    text = chat_markdown(info, store.messages(chat))
    assert text.index("## smollm2") < text.index("hello") < text.index("## gemma3-270m")
    assert first
    store.close()
