"""The chat TUI's pure parts: stats line, slash commands, key remapping, the chat database."""

from __future__ import annotations

import sqlite3

import pytest

from localllm.tui import keys
from localllm.tui.chatstore import ChatStore, chat_markdown
from localllm.tui.slash import Command, SlashError, common_prefix, completions, parse
from localllm.tui.stats import (
    DecodeRate,
    RunnerStats,
    TurnStats,
    answer_footer,
    find_runner,
    fit_line,
    segments,
)
from localllm.tui.widgets import open_block, unwrap_block

CHUNK = {"eval_count": 50, "eval_duration": 500_000_000, "prompt_eval_count": 200,
         "prompt_eval_duration": 100_000_000, "context_used": 250, "context_length": 4096,
         "time_to_first_token": 150_000_000}
STATS_ENTRY = {"model": "smollm2:latest", "runner_pid": 42, "rss_bytes": 300 << 20,
               "vram_bytes": 3 << 30, "vram_source": "plan", "context_length": 4096,
               "plan": {"gpu_layers": 20, "layers": 31, "kv_type": "q8_0", "n_ctx": 4096}}


# ---- stats -------------------------------------------------------------------------------
def test_turn_rates_come_from_the_runner_counters():
    turn = TurnStats.from_wire(CHUNK)
    assert turn.decode_rate == pytest.approx(100.0)
    assert turn.prompt_rate == pytest.approx(2000.0)
    assert TurnStats.from_wire(turn.to_wire()) == turn


def test_live_rate_is_exact_over_the_window_and_forgets_old_samples():
    rate = DecodeRate(window_ns=1_000_000_000)
    assert rate.rate is None
    # 10 tok/s for the first 2 s, then 50 tok/s: the window must show only the new speed.
    for i in range(21):
        rate.add(i, i * 100_000_000)
    assert rate.rate == pytest.approx(10.0)
    for j in range(1, 101):
        rate.add(20 + j, 2_000_000_000 + j * 20_000_000)
    assert rate.rate == pytest.approx(50.0, rel=0.05)
    rate.add(5, 9)  # out of order or repeated counts are ignored
    assert rate.rate == pytest.approx(50.0, rel=0.05)


def test_estimated_vram_carries_a_tilde_and_measured_does_not():
    runner = RunnerStats.from_wire(STATS_ENTRY)
    line = fit_line(segments(TurnStats.from_wire(CHUNK), 98.0, runner, True), 200)
    assert "▶ 98.0 tok/s" in line and "ctx 250/4096" in line
    assert "VRAM ~3.2 GB" in line and "runner RAM 315 MB" in line  # decimal, as `list` and Ollama
    assert "GPU 20/31 layers" in line and "KV q8_0" in line
    measured = RunnerStats.from_wire({**STATS_ENTRY, "vram_source": "nvml"})
    assert "VRAM 3.2 GB" in fit_line(segments(None, None, measured, False), 200)
    no_gpu = RunnerStats.from_wire({**STATS_ENTRY, "vram_bytes": None, "vram_source": None})
    assert "VRAM" not in fit_line(segments(None, None, no_gpu, False), 200)


def test_draft_acceptance_shows_only_when_speculation_is_on():
    turn = TurnStats.from_wire({**CHUNK, "draft": {"drafted": 40, "accepted": 30}})
    assert "draft 30/40 75%" in fit_line(segments(turn, None, None, False), 200)
    assert "draft" not in fit_line(segments(TurnStats.from_wire(CHUNK), None, None, False), 200)
    assert "draft 30/40" in answer_footer(turn)


def test_narrow_line_drops_the_least_important_parts_first():
    parts = segments(TurnStats.from_wire(CHUNK), 98.0, RunnerStats.from_wire(STATS_ENTRY), True)
    wide, narrow = fit_line(parts, 200), fit_line(parts, 60)
    assert len(narrow) <= 60 < len(wide)
    assert narrow.startswith("▶ 98.0 tok/s") and "ctx 250/4096" in narrow
    assert "KV" not in narrow


def test_find_runner_matches_the_default_tag():
    stats = {"models": [STATS_ENTRY]}
    assert find_runner(stats, "smollm2").pid == 42
    assert find_runner(stats, "smollm2:latest").pid == 42
    assert find_runner(stats, "gemma3") is None


# ---- slash commands ----------------------------------------------------------------------
def test_slash_commands_parse_to_typed_values():
    assert parse("/set parameter temperature 0.5") == \
        Command("set parameter", ("temperature", 0.5))
    assert parse("/set parameter num_predict 3") == Command("set parameter", ("num_predict", 3))
    assert parse("/set parameter stop <|end|> \\n") == \
        Command("set parameter", ("stop", ["<|end|>", "\n"]))
    assert parse("/set system  You are terse.") == Command("set system", ("You are terse.",))
    assert parse("/show plan") == Command("show", ("plan",))
    assert parse("/save my chat") == Command("save", ("my chat",))
    assert parse("/load gemma3-270m") == Command("load", ("gemma3-270m",))
    assert parse("/?") == Command("help")


@pytest.mark.parametrize("line, message", [
    ("/frobnicate", "unknown command '/frobnicate'"),
    ("/set parameter temperature hot", "temperature must be a number, not 'hot'"),
    ("/set parameter top_p 2", "top_p must be between 0 and 1, not 2"),
    ("/set parameter num_predict 1.5", "num_predict must be a whole number"),
    ("/set parameter temprature 1", "unknown parameter 'temprature'"),
    ("/set parameter temperature nan", "temperature must be a number"),
    ("/show everything", "usage: /show"),
    ("/load", "usage: /load MODEL"),
])
def test_bad_commands_say_what_is_wrong(line, message):
    with pytest.raises(SlashError, match=message.replace("(", r"\(").replace("|", r"\|")):
        parse(line)


def test_completion_of_commands_parameters_and_models():
    assert completions("/se") == ["/set"]
    assert completions("/set p") == ["/set parameter"]
    assert completions("/set parameter te") == ["/set parameter temperature"]
    assert completions("/show p") == ["/show parameters", "/show plan"]
    assert common_prefix(completions("/show p")) == "/show p"
    assert completions("/load ge", ["smollm2", "gemma3-270m"]) == ["/load gemma3-270m"]
    assert completions("hello") == []


def test_triple_quotes_open_and_close_a_block():
    assert open_block('"""first line') and not open_block('"""a\nb"""')
    assert open_block('"""') and not open_block("plain")
    assert unwrap_block('"""\nline one\nline two\n"""') == "line one\nline two"


# ---- keys --------------------------------------------------------------------------------
def test_keymap_from_config_is_checked(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('keep_alive = "5m"\n[keys]\nstop = "escape,ctrl+c"\n'
                      'send = 5\nfly = "f1"\nnew_line = "ctrl+j, alt+enter"\n')
    keymap, warnings = keys.read_keymap(config)
    assert keymap == {"stop": "escape,ctrl+c", "new_line": "ctrl+j,alt+enter"}
    assert any("send" in w for w in warnings) and any("fly: unknown" in w for w in warnings)
    actions = keys.input_actions(keymap)
    assert actions["alt+enter"] == "new_line" and "shift+enter" not in actions
    assert actions["enter"] == "submit"
    assert "escape, ctrl+c" in keys.describe(keymap)


def test_a_keys_table_does_not_break_the_daemon_config(tmp_path):
    from localllm.config import load_config

    config = tmp_path / "config.toml"
    config.write_text('keep_alive = "1m"\n[keys]\nstop = "escape"\n')
    assert load_config(config, environ={}).keep_alive == "1m"


# ---- chat database -----------------------------------------------------------------------
def test_chats_are_saved_as_they_go_and_exported(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("smollm2", system="Be brief.", options={"temperature": 0})
    store.add_message(chat, "user", "What is 2+2?")
    answer = store.add_message(chat, "assistant", "", state="streaming")
    store.update_message(answer, "4", "done", TurnStats.from_wire(CHUNK).to_wire())
    store.update_chat(chat, name="maths")
    store.close()

    reopened = ChatStore(tmp_path / "chats.db")  # a new process sees everything
    info = reopened.find_chat("maths")
    assert info.id == chat and info.title == "maths" and info.options == {"temperature": 0}
    assert reopened.find_chat("") == info and reopened.find_chat(str(chat)) == info
    messages = reopened.messages(chat)
    assert [(m.role, m.content, m.state) for m in messages] == \
        [("user", "What is 2+2?", "done"), ("assistant", "4", "done")]
    assert messages[1].stats["eval_count"] == 50
    assert reopened.prompt_history() == ["What is 2+2?"]
    text = chat_markdown(info, messages)
    assert text.startswith("# maths") and "## You\n\nWhat is 2+2?" in text
    assert "## smollm2\n\n4" in text and "Be brief." in text


def test_a_turns_images_are_saved_with_it_and_go_with_its_chat(tmp_path):
    store = ChatStore(tmp_path / "chats.db")
    chat = store.create_chat("vl")
    store.add_message(chat, "user", "What is this?", images=("aW1hZ2Ux", "aW1hZ2Uy"))
    store.add_message(chat, "assistant", "Two squares.")
    other = store.create_chat("vl")
    store.add_message(other, "user", "And this?", images=("aW1hZ2Uz",))
    store.close()
    reopened = ChatStore(tmp_path / "chats.db")
    assert [m.images for m in reopened.messages(chat)] == [("aW1hZ2Ux", "aW1hZ2Uy"), ()]
    reopened.delete_chat(chat)
    count = reopened.db.execute("SELECT COUNT(*) FROM image").fetchone()[0]
    assert count == 1, "a deleted chat's images go with it"
    assert [m.images for m in reopened.messages(other)] == [("aW1hZ2Uz",)]


def test_a_database_from_a_newer_version_is_refused(tmp_path):
    path = tmp_path / "chats.db"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(sqlite3.DatabaseError, match="newer localllm"):
        ChatStore(path)


def test_speculative_parameters_take_one_known_value():
    from localllm.tui.slash import SlashError, parse_parameter

    assert parse_parameter("speculative", ["lookup"]) == ("speculative", "lookup")
    assert parse_parameter("draft_model", ["smollm2"]) == ("draft_model", "smollm2")
    for bad in (["sometimes"], ["lookup", "mtp"]):
        try:
            parse_parameter("speculative", bad)
        except SlashError as e:
            assert "speculative" in str(e)
        else:
            raise AssertionError(f"{bad} was accepted")


def test_sizes_read_the_same_everywhere():
    from localllm.cli.commands import human_size as cli_size
    from localllm.cli.pull_progress import size_text
    from localllm.units import human_size

    assert cli_size is human_size is size_text  # list, show, ps, pull and the chat: one rule
    assert [human_size(n) for n in (512, 98_362_432, 253_113_024, 3 << 30, 42_500_000_000)] \
        == ["512 B", "98 MB", "253 MB", "3.2 GB", "42.5 GB"]
