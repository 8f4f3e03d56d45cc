"""The chat app's conversation (tui/conversation.py), without a screen: what it saves in a real
chat store and when, what the daemon is sent, and a store that fails mid-chat."""

from __future__ import annotations

from localllm.tui.chatstore import ChatStore
from localllm.tui.conversation import Conversation
from localllm.tui.widgets import Entry


def test_a_chat_is_saved_from_its_first_turn_with_the_settings_it_has(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = Conversation(store, "smollm2")
    chat.set_system("Be brief.")
    chat.set_option("temperature", 0.0)
    assert chat.chat_id is None and store.chats() == []  # settings alone save nothing
    chat.add(Entry("user", "hello"))
    saved = store.get_chat(chat.chat_id)
    assert saved.system == "Be brief." and saved.options == {"temperature": 0.0}
    chat.unset_option("temperature")
    chat.use_model("gemma3-270m")
    assert chat.rename("greetings")
    saved = store.get_chat(chat.chat_id)
    assert saved.options == {} and saved.model == "gemma3-270m" and saved.name == "greetings"
    assert chat.title() == "gemma3-270m · greetings"


def test_the_daemon_gets_the_system_message_and_every_turn_that_has_something(tmp_path):
    chat = Conversation(ChatStore(tmp_path / "chats.db"), "smollm2")
    chat.set_system("Be brief.")
    chat.add(Entry("user", "hello"))
    chat.add(Entry("assistant", "", "error"))  # a failed answer is not sent back
    chat.add(Entry("user", "", images=("aW1n",)))
    chat.add(Entry("assistant", "hi"))
    assert chat.request_messages() == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"},
        {"role": "user", "content": "", "images": ["aW1n"]},
        {"role": "assistant", "content": "hi"}]


def test_answering_again_drops_the_last_answers_from_the_store(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = Conversation(store, "smollm2")
    chat.add(Entry("user", "hello"))
    answer = chat.add(Entry("assistant", "", "streaming"))
    chat.save(answer, "hi there", "done", {"context_used": 40, "context_length": 512})
    assert [m.content for m in store.messages(chat.chat_id)] == ["hello", "hi there"]

    reopened = Conversation(store, "smollm2")
    info, messages = reopened.reopen(chat.chat_id)
    assert info.id == chat.chat_id and len(messages) == 2
    assert reopened.turn.context_used == 40 and reopened.turn.context_length == 512

    assert [e.content for e in chat.drop_last_answers()] == [""]
    assert [m.content for m in store.messages(chat.chat_id)] == ["hello"]
    chat.clear()
    assert chat.chat_id is None and not chat.entries and store.get_chat(info.id) is not None


def test_a_store_that_fails_is_said_once_and_the_chat_goes_on(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    said: list[str] = []
    chat = Conversation(store, "smollm2", said.append)
    store.close()
    chat.add(Entry("user", "hello"))
    chat.add(Entry("user", "still here"))
    assert len(said) == 1 and said[0].startswith(f"Cannot save the chat in {store.path}")
    assert [m["content"] for m in chat.request_messages()] == ["hello", "still here"]
    assert chat.reopen(1) is None
