"""The chat app driven with Textual's Pilot against a real daemon and real llama.cpp (smollm2)."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import pytest

from daemon_process import wait_for

from localllm.config import Config
from localllm.tui.app import ChatApp, last_exchange
from localllm.tui.chatstore import ChatStore
from localllm.tui.widgets import Note, StatsLine

LOOPING_PROMPT = "Write a very long story about a dragon who counts sheep, one by one."


async def wait_loaded(pilot, app) -> None:
    await wait_until(pilot, lambda: app.runner is not None, "the model to load")


async def start_a_long_answer(pilot, app, tokens_seen: int) -> None:
    """Load, ask for an answer that would run for minutes, and wait until it is streaming."""
    await wait_loaded(pilot, app)
    await type_line(pilot, app, "/set parameter num_predict 4000")
    await type_line(pilot, app, "/set parameter temperature 0")  # greedy: no early stop
    await type_line(pilot, app, LOOPING_PROMPT)
    await wait_until(pilot, lambda: app.chat.turn is not None
                     and app.chat.turn.eval_count >= tokens_seen, "the answer to start")


def config_for(daemon) -> Config:
    return Config(host=daemon.url.removeprefix("http://"), socket=str(daemon.socket))


async def wait_until(pilot, predicate, what: str, timeout: float = 240):
    # Generous: on a shared 2-core machine smollm2 can fall to a few tokens a second.
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            app = pilot.app
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; the chat "
                                 f"says {notes(app)}, streaming={app.streaming}, "
                                 f"turn={app.chat.turn}")
        await pilot.pause(0.05)  # ok-sleep: the poll interval of a deadline loop


async def type_line(pilot, app: ChatApp, text: str) -> None:
    app.prompt.load_text(text)
    await pilot.press("enter")


def notes(app: ChatApp, kind: str | None = None) -> list[str]:
    return [n.text for n in app.query(Note) if kind is None or n.kind == kind]


def stats_text(app: ChatApp) -> str:
    return str(app.query_one(StatsLine).render())


def post(daemon, path: str, body: dict) -> dict:
    request = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(),
                                     method="DELETE" if path == "/api/delete" else "POST")
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read() or b"{}")


def runner_stats(daemon, model: str) -> dict:
    wanted = model if ":" in model else f"{model}:latest"
    return next(m for m in daemon.get("/api/stats")["models"] if m["model"] == wanted)


@pytest.fixture
def chats(home):
    chats = ChatStore(home / "chats.db")
    yield chats
    chats.close()


async def test_an_answer_streams_with_live_speed_and_context_use(daemon, chats):
    app = ChatApp(config_for(daemon), "smollm2", store=chats)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_loaded(pilot, app)
        assert any("smollm2 ready" in n for n in notes(app))
        await type_line(pilot, app, "/set parameter num_predict 48")
        await type_line(pilot, app, "/set parameter temperature 0")  # greedy: no early stop
        await type_line(pilot, app, LOOPING_PROMPT)
        live_rates = []

        def sample() -> bool:
            match = re.search(r"▶ ([\d.]+k?) tok/s", stats_text(app))
            if match:
                live_rates.append(float(match.group(1).rstrip("k")))
            return not app.streaming and app.chat.entries[-1].state != "streaming"

        await wait_until(pilot, sample, "the answer to finish")
        answer = app.chat.entries[-1]
        assert answer.state == "done" and answer.content.strip()
        assert live_rates and max(live_rates) > 0, "no live decode speed while streaming"
        await wait_until(pilot, lambda: "tok/s · 48 tok" in stats_text(app),
                         "the stats line to show the whole answer")
        final = stats_text(app)
        rate = float(re.search(r"([\d.]+) tok/s · 48 tok", final).group(1))
        used, n_ctx = map(int, re.search(r"ctx (\d+)/(\d+)", final).groups())
        assert rate > 0 and n_ctx == 4096 and used > 48
        assert "RAM" in final  # the runner's resident memory, from /api/stats
        # The daemon agrees: it generated exactly what the stats line counted.
        last = runner_stats(daemon, "smollm2")["last"]
        assert last["eval_count"] == 48 == app.chat.turn.eval_count
        # Saved as it went: the database holds the prompt and the whole answer.
        messages = chats.messages(app.chat.chat_id)
        assert [m.role for m in messages] == ["user", "assistant"]
        assert messages[1].content == answer.content and messages[1].stats["eval_count"] == 48


async def test_a_set_parameter_reaches_the_daemon(daemon, chats):
    app = ChatApp(config_for(daemon), "smollm2", store=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_loaded(pilot, app)
        await type_line(pilot, app, "/set parameter num_predict 3")
        await type_line(pilot, app, "/set parameter temperature 0")
        await type_line(pilot, app, "/set verbose")
        await type_line(pilot, app, LOOPING_PROMPT)
        await wait_until(pilot, lambda: not app.streaming and app.chat.turn and app.chat.turn.done,
                         "the answer")
        last = runner_stats(daemon, "smollm2")["last"]
        assert last["eval_count"] == 3 and last["done_reason"] == "length"
        # /set verbose: Ollama's timings block after the answer, with the answer's own counts
        def timings_note() -> str | None:
            return next((n for n in notes(app) if n.startswith("total duration:")), None)

        await wait_until(pilot, timings_note, "the timings after the answer", timeout=30)
        timings = timings_note()
        for line in ("load duration:", "prompt eval count:", "prompt eval duration:",
                     "prompt eval rate:", "eval duration:", "eval rate:"):
            assert line in timings, timings
        assert re.search(r"^eval count: +3 token\(s\)$", timings, re.M), timings
        await type_line(pilot, app, "/set quiet")
        assert chats.get_chat(app.chat.chat_id).options == {"num_predict": 3, "temperature": 0.0}
        await type_line(pilot, app, "/unset parameter num_predict")
        await type_line(pilot, app, "/set parameter num_predict 5")
        await type_line(pilot, app, LOOPING_PROMPT)
        await wait_until(pilot, lambda: not app.streaming and app.chat.turn.eval_count == 5,
                         "the second answer")
        assert runner_stats(daemon, "smollm2")["last"]["eval_count"] == 5
        first = app.chat.entries[-1]
        await type_line(pilot, app, "/regen")
        await wait_until(pilot, lambda: app.chat.entries[-1] is not first
                         and app.chat.entries[-1].state == "done", "the answer again")
        assert first.view.parent is None  # the old answer left the screen
        assert [e.role for e in app.chat.entries] == ["user", "assistant", "user", "assistant"]
        assert [m.id for m in chats.messages(app.chat.chat_id)][-1] == app.chat.entries[-1].db_id
        assert len(chats.messages(app.chat.chat_id)) == 4


async def test_ctrl_c_stops_the_answer_in_the_daemon_and_two_more_quit(daemon, chats):
    app = ChatApp(config_for(daemon), "smollm2", store=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        await start_a_long_answer(pilot, app, tokens_seen=8)
        await pilot.press("ctrl+c")
        await wait_until(pilot, lambda: not app.streaming, "the answer to stop")
        # The Ctrl+C that stopped the answer does not count toward quitting: a reflexive
        # second press (ollama run's habit) leaves the chat open, a third within 3 s quits.
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert app.is_running
        await pilot.press("ctrl+c")
        await wait_until(pilot, lambda: not app.is_running, "the app to quit", timeout=10)
    assert app.return_code == 0
    answer = app.chat.entries[-1]
    assert answer.state == "stopped" and answer.content
    assert answer.view.footer.endswith("stopped")
    # What run_chat leaves on the terminal when the chat closes: the last question and answer.
    assert last_exchange(app.chat.entries) == f">>> {LOOPING_PROMPT}\n{answer.content.rstrip()}"

    def runner_idle() -> dict | None:
        stats = runner_stats(daemon, "smollm2")
        return stats if not stats["busy"] and stats["last"]["done_reason"] == "cancelled" \
            else None

    stats = wait_for(runner_idle, 30, what="the daemon to stop generating")
    assert app.chat.turn.eval_count <= stats["last"]["eval_count"] < 4000
    assert chats.messages(app.chat.chat_id)[-1].state == "stopped"
    assert chats.messages(app.chat.chat_id)[-1].content == answer.content
    assert runner_stats(daemon, "smollm2")["tokens_generated"] == stats["tokens_generated"]


async def test_bad_commands_show_a_message_and_the_chat_goes_on(daemon, chats):
    app = ChatApp(config_for(daemon), "smollm2", store=chats)
    async with app.run_test(size=(80, 24)) as pilot:
        await wait_loaded(pilot, app)
        await type_line(pilot, app, "/frobnicate now")
        await type_line(pilot, app, "/set parameter temperature hot")
        await type_line(pilot, app, "/set parameter top_p 7")
        await wait_until(pilot, lambda: len(notes(app, "error")) == 3, "three error notes")
        errors = notes(app, "error")
        assert "unknown command '/frobnicate'" in errors[0]
        assert "temperature must be a number, not 'hot'" in errors[1]
        assert "top_p must be between 0 and 1" in errors[2]
        assert app.chat.options == {}
        await type_line(pilot, app, "/show parameters")
        await wait_until(pilot, lambda: any("Model defined parameters" in n for n in notes(app)),
                         "the app to keep answering")
        await pilot.press("ctrl+c")  # idle: one Ctrl+C only says how to quit
        await pilot.pause()
        assert app.is_running
        app.prompt.load_text("draft")
        await pilot.press("home", "ctrl+d")  # with text, Ctrl+D deletes as in a shell
        assert app.prompt.text == "raft" and app.is_running
        app.prompt.load_text("")
        await pilot.press("ctrl+d")
        await wait_until(pilot, lambda: not app.is_running, "Ctrl+D to quit", timeout=10)


async def test_model_deleted_mid_chat(daemon, chats):
    post(daemon, "/api/copy", {"source": "smollm2", "destination": "tui-victim"})
    app = ChatApp(config_for(daemon), "tui-victim", store=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_loaded(pilot, app)
        await type_line(pilot, app, "/set parameter num_predict 200")
        await type_line(pilot, app, "/set parameter temperature 0")  # greedy: no early stop
        await type_line(pilot, app, LOOPING_PROMPT)
        await wait_until(pilot, lambda: app.chat.turn is not None and app.chat.turn.eval_count >= 4,
                         "the answer to start")
        await asyncio.to_thread(post, daemon, "/api/delete", {"model": "tui-victim"})
        await wait_until(pilot, lambda: not app.streaming, "the answer to end")
        first_answer = app.chat.entries[-1].content
        await type_line(pilot, app, "Are you still there?")
        await wait_until(pilot, lambda: any("not found" in n for n in notes(app, "error")),
                         "a model-not-found message")
        [hint] = [n for n in notes(app, "error") if "not found" in n]
        assert "`localllm pull tui-victim`" in hint and "/load one of" in hint and "smollm2" in hint
        await type_line(pilot, app, "/show system")
        await wait_until(pilot, lambda: "No system message." in notes(app), "a reply")
    messages = chats.messages(app.chat.chat_id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1].content == first_answer and messages[3].state == "error"


async def test_keys_typed_after_load_of_a_missing_model_stay_in_the_prompt(daemon, chats):
    """Bug 8: `/load` of a model that is not stored opened a question that took every key
    typed on after the command (and a typed-ahead Enter would have answered it)."""
    from localllm.tui.screens import ConfirmScreen

    app = ChatApp(config_for(daemon), "smollm2", store=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        await wait_loaded(pilot, app)
        await pilot.press(*"/load nosuch", "enter", *"hello")
        await wait_until(pilot, lambda: notes(app, "warning"), "the note on the missing model")
        await pilot.press(*" there")
        assert app.prompt.text == "hello there"
        assert not isinstance(app.screen, ConfirmScreen) and app.chat.model == "smollm2"
        [note] = notes(app, "warning")
        assert note.startswith("nosuch is not in the store: pull it with "
                               "`localllm pull nosuch`") and "gemma3-270m" in note
        app.prompt.load_text("")
        await pilot.press(*"/load gemma3-270m", "enter", *"more")  # a stored one: it loads
        await wait_until(pilot, lambda: app.chat.model == "gemma3-270m" and app.runner is not None,
                         "gemma3-270m to load")
        assert app.prompt.text == "more" and not app.chat.entries
        # gemma3-270m's file has no chat template: the chat says what that means, once;
        # smollm2 (with one) had no such note
        await wait_until(pilot, lambda: any("has no chat template" in n for n in notes(app)),
                         "the base-model note")
        assert [n for n in notes(app) if "has no chat template" in n] == [
            "gemma3-270m has no chat template (a base model): it continues what you write "
            "rather than answering it; your messages go to it as plain text."]


async def test_daemon_killed_mid_chat(fresh_daemon, chats):
    app = ChatApp(config_for(fresh_daemon), "smollm2", store=chats)
    async with app.run_test(size=(100, 30)) as pilot:
        await start_a_long_answer(pilot, app, tokens_seen=4)
        fresh_daemon.proc.kill()
        await wait_until(pilot, lambda: notes(app, "error"), "a lost-daemon message")
        [lost] = notes(app, "error")
        # What happened, where to read why, and what to do; no Python exception names.
        assert lost.startswith("Lost the connection to the daemon mid-answer: it stopped or "
                               "crashed") and "`localllm service logs`" in lost
        assert "send again" in lost
        assert not re.search(r"[A-Z][a-z]+(Error|Exception)\b", lost), lost
        shown = app.chat.entries[-1].content
        assert not app.streaming and app.chat.entries[-1].state == "error" and shown
        await type_line(pilot, app, "/show parameters")
        await wait_until(pilot, lambda: any("num_predict" in n for n in notes(app)),
                         "the app to keep answering")
    messages = chats.messages(app.chat.chat_id)
    assert [(m.role, m.state) for m in messages] == [("user", "done"), ("assistant", "error")]
    assert messages[1].content == shown and messages[0].content == LOOPING_PROMPT


async def test_a_missing_model_is_pulled_with_progress_then_loaded(tmp_path, smollm2_gguf,
                                                                   chats):
    from daemon_process import isolated_env, start_daemon
    from hub_server import Hub

    from localllm.tui.screens import ConfirmScreen
    from localllm.tui.widgets import ProgressLine

    repo, name = "test/SmolLM2-GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf"
    with Hub() as hub:
        hub.add(repo, name, smollm2_gguf)
        hub.hold_after = smollm2_gguf.stat().st_size // 2  # stop half-way until released
        daemon = start_daemon(isolated_env(tmp_path / "d", LOCALLLM_HF_ENDPOINT=hub.url))
        try:
            model = f"hf.co/{repo}:Q4_1"
            app = ChatApp(config_for(daemon), model, store=chats)
            async with app.run_test(size=(100, 30)) as pilot:
                await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen),
                                 "the offer to pull")
                await pilot.press("y")
                size = smollm2_gguf.stat().st_size
                bar = app.query_one(ProgressLine).query_one("ProgressBar")
                await wait_until(pilot, lambda: hub.holding and bar.total == size,
                                 "the progress bar of the pull")
                assert bar.progress < size
                assert "Pulling" in str(app.query_one("#progress-label").render())
                hub.release()
                await wait_loaded(pilot, app)
                assert any(f"Pulled {model} (98 MB)" in n for n in notes(app))
                assert not app.query_one(ProgressLine).display
                await type_line(pilot, app, "/set parameter num_predict 4")
                await type_line(pilot, app, "/set parameter temperature 0")  # no early stop
                await type_line(pilot, app, LOOPING_PROMPT)
                await wait_until(pilot, lambda: not app.streaming and app.chat.turn
                                 and app.chat.turn.eval_count == 4, "an answer")
        finally:
            daemon.stop()


async def test_the_daemon_is_started_when_none_runs(home, smollm2_gguf, monkeypatch, chats):
    import os
    import signal

    from conftest import import_models

    from localllm.config import load_config

    monkeypatch.setenv("LOCALLLM_HOST", "127.0.0.1:0")  # the Unix socket is what the TUI finds
    import_models(dict(os.environ), {"smollm2": smollm2_gguf})
    app = ChatApp(load_config(), "smollm2", store=chats)
    daemon_pid = None
    try:
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_until(pilot, lambda: app.runner is not None,
                             "a daemon to start and load the model")
            daemon_pid = (await app.client.request("GET", "/api/status"))["pid"]
            assert daemon_pid != os.getpid()
            await type_line(pilot, app, "/set parameter num_predict 4")
            await type_line(pilot, app, "/set parameter temperature 0")  # no early stop
            await type_line(pilot, app, LOOPING_PROMPT)
            await wait_until(pilot, lambda: not app.streaming and app.chat.turn
                             and app.chat.turn.eval_count == 4, "an answer")
    finally:
        if daemon_pid:
            os.kill(daemon_pid, signal.SIGTERM)
            wait_for(lambda: process_state(daemon_pid) in (None, "Z"), 30,
                     what="the daemon the TUI started to stop")


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (Z: exited, not reaped), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


async def test_after_load_the_bar_shows_the_new_context_and_a_cached_regenerate_no_rate(
        daemon, chats):
    """The bar kept the last answer's context after /load until the next answer; a regenerate
    whose prompt the runner had cached read "prompt 1 tok at 1.2 tok/s"."""
    try:
        app = ChatApp(config_for(daemon), "smollm2", store=chats)
        async with app.run_test(size=(140, 30)) as pilot:
            await wait_loaded(pilot, app)
            for line in ("/set parameter num_ctx 2048", "/set parameter num_predict 4", "Hi!"):
                await type_line(pilot, app, line)
            await wait_until(pilot, lambda: not app.streaming and app.chat.turn is not None
                             and app.chat.turn.done, "the first answer")
            await wait_until(pilot, lambda: re.search(r"ctx \d+/2048 ", stats_text(app)),
                             "the bar to show 2048")
            for _ in range(2):  # the second regenerate finds the whole prompt cached
                before = app.chat.entries[-1]
                await pilot.press("ctrl+r")
                await wait_until(pilot, lambda old=before: not app.streaming
                                 and app.chat.entries[-1] is not old
                                 and app.chat.entries[-1].state == "done", "the regenerate")
            footer = app.chat.entries[-1].view.footer
            assert "prompt 1 tok at" not in footer and "prompt tok cached" in footer, footer
            await type_line(pilot, app, "/unset parameter num_ctx")
            await type_line(pilot, app, "/load gemma3-270m")
            await wait_until(pilot, lambda: app.chat.model == "gemma3-270m"
                             and app.runner is not None, "gemma3-270m to load")
            assert app.runner.n_ctx != 2048
            await wait_until(pilot, lambda: f"/{app.runner.n_ctx} " in stats_text(app),
                             "the bar to show the new model's context", timeout=10)
    finally:
        daemon.unload("smollm2")  # loaded at num_ctx 2048: the next test must not find it


async def test_a_resumed_chat_labels_each_answer_with_the_model_that_wrote_it(daemon, chats):
    app = ChatApp(config_for(daemon), "smollm2", store=chats)
    async with app.run_test(size=(120, 30)) as pilot:
        await wait_loaded(pilot, app)
        await type_line(pilot, app, "/set parameter num_predict 3")
        for turn, model in enumerate(("smollm2", "gemma3-270m"), 1):
            if model != app.chat.model:
                await type_line(pilot, app, f"/load {model}")
                await wait_until(pilot, lambda m=model: app.chat.model == m
                                 and app.runner is not None, f"{model} to load")
            await type_line(pilot, app, "Hi!")
            # this turn's two entries, its answer done (not the last turn's, on a slow machine)
            await wait_until(pilot, lambda n=2 * turn: not app.streaming
                             and len(app.chat.entries) == n
                             and app.chat.entries[-1].state == "done", f"{model}'s answer")
        chat_id = app.chat.chat_id
    resumed = ChatApp(config_for(daemon), "smollm2", store=chats, resume=str(chat_id))
    async with resumed.run_test(size=(120, 30)) as pilot:
        await wait_until(pilot, lambda: len(resumed.chat.entries) == 4, "the chat to reopen")
        assert [e.view.who for e in resumed.chat.entries] == [
            "You", "smollm2", "You", "gemma3-270m"]
