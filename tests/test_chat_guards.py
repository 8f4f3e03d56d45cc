"""What a chat says when an answer goes wrong (issue 38): the loop guard in the chat screen and
the line chat as in the one-shot run, a note when the context is full and when the oldest turns
were left out, and the whole input in prompt_eval_count with the cached part beside it. Real
daemon, real llama.cpp (SmolLM2), the chat app driven by Textual's Pilot."""

from __future__ import annotations

import json
import re
import urllib.request

from localllm.repeats import LoopGuard, repeating_tail
from localllm.tui.app import ChatApp
from localllm.tui.chatstore import ChatStore

from test_tui_app import config_for, notes, type_line, wait_loaded, wait_until

# Greedy SmolLM2 says "ha" over and over (tests/test_first_hour.py's one-shot loop).
HA_PROMPT = "Say 'ha' 300 times: ha ha ha ha ha ha ha ha ha ha ha ha"
# About 150 tokens of prompt: SmolLM2's greedy count (121 tokens alone) overruns 256.
COUNTING = ("My notes for the school fair: the stalls open at nine, the bake sale is in the "
            "hall, the raffle is drawn at noon, the band plays from one until three, and the "
            "parents' committee tidies up at four. The children from every class bring one "
            "cake each, the teachers bring the tables, and the caretaker opens the gates. "
            "Tickets cost one pound for adults and nothing for children under five. Please, "
            "list the numbers from 1 to 500, separated by commas.")


def post(daemon, path: str, body: dict) -> dict:
    request = urllib.request.Request(daemon.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        return json.loads(resp.read())


def test_a_repeated_paragraph_longer_than_200_characters_is_a_loop():
    paragraph = ("The committee met again on Tuesday to review the budget for the new library, "
                 "and after a long discussion about shelving, lighting and the reading room, "
                 "it agreed to meet again next week, on Wednesday, to decide. ")
    assert len(paragraph) > 200
    assert repeating_tail(paragraph * 19) == len(paragraph)
    assert repeating_tail(paragraph * 3) == 0  # three times is not yet a loop
    guard = LoopGuard()
    fed = [guard.feed(piece) for piece in re.findall(r"\S+\s*", paragraph * 5)]
    assert fed[-1] == len(paragraph) and not any(fed[:len(fed) // 2])


def test_prompt_eval_count_is_the_whole_input_with_the_cached_part_beside_it(fresh_daemon):
    body = {"model": "smollm2", "stream": False, "keep_alive": "5m",
            "options": {"temperature": 0, "num_predict": 2},
            "messages": [{"role": "user", "content": "Name three rivers of Europe."}]}
    first = post(fresh_daemon, "/api/chat", body)
    again = post(fresh_daemon, "/api/chat", body)
    assert first["prompt_eval_count"] > 20 and first["prompt_eval_cached_count"] == 0
    # Ollama's shape: the same input counts the same; what the cache held is said beside it.
    assert again["prompt_eval_count"] == first["prompt_eval_count"]
    assert again["prompt_eval_cached_count"] >= first["prompt_eval_count"] - 2
    assert again["stats"]["prompt_eval_count"] <= 2  # the runner read only the rest
    generate = {"model": "smollm2", "stream": False, "prompt": "Name three rivers of Europe.",
                "options": {"temperature": 0, "num_predict": 2}}
    g1, g2 = post(fresh_daemon, "/api/generate", generate), post(fresh_daemon, "/api/generate",
                                                                  generate)
    assert g1["prompt_eval_count"] == g2["prompt_eval_count"] > 10
    assert g2["prompt_eval_cached_count"] >= g2["prompt_eval_count"] - 2
    verbose = fresh_daemon.cli("run", "smollm2", "--verbose", "--num-predict", "2",
                               "Name three rivers of Europe.")
    assert verbose.returncode == 0, verbose.stderr
    line = next(x for x in verbose.stderr.splitlines() if x.startswith("prompt eval count:"))
    assert "cached)" in line  # the one-shot's --verbose says how much came from the cache


async def test_the_chat_screen_stops_an_answer_that_loops(fresh_daemon, home):
    chats = ChatStore(home / "chats.db")
    app = ChatApp(config_for(fresh_daemon), "smollm2", store=chats)
    async with app.run_test(size=(110, 30)) as pilot:
        await wait_loaded(pilot, app)
        await type_line(pilot, app, "/set parameter temperature 0")
        await type_line(pilot, app, "/set parameter num_predict 2000")
        await type_line(pilot, app, HA_PROMPT)
        await wait_until(pilot, lambda: any("kept repeating the same" in n
                                            for n in notes(app, "warning")),
                         "the loop note", timeout=600)
        answer = app.chat.entries[-1]
        assert answer.state == "stopped" and not app.streaming
        assert 80 <= answer.content.count("ha") < 1000  # stopped in the loop, far before 2000
        assert chats.messages(app.chat.chat_id)[-1].state == "stopped"
    chats.close()


async def test_a_full_context_and_the_turns_left_out_are_said(fresh_daemon, home):
    chats = ChatStore(home / "chats.db")
    app = ChatApp(config_for(fresh_daemon), "smollm2", store=chats)
    async with app.run_test(size=(110, 30)) as pilot:
        await type_line(pilot, app, "/set parameter num_ctx 256")
        await type_line(pilot, app, "/set parameter temperature 0")
        await wait_loaded(pilot, app)
        await type_line(pilot, app, COUNTING)
        await wait_until(pilot, lambda: any("context is full" in n for n in notes(app)),
                         "the context-full note", timeout=600)
        assert app.chat.turn.context_length == 256 and app.chat.turn.done_reason == "length"
        await type_line(pilot, app, "/set parameter num_predict 4")
        await type_line(pilot, app, "Thanks. And now from 1000 down?")
        await wait_until(pilot, lambda: any("left out of what the model read" in n
                                            for n in notes(app)), "the dropped-turns note",
                         timeout=600)
        note = next(n for n in notes(app) if "left out" in n)
        assert "oldest 2 message(s)" in note and "256" in note
    chats.close()


def test_the_line_chat_takes_ollamas_set_and_show_commands(fresh_daemon, gemma_gguf):
    imported = fresh_daemon.cli("import", str(gemma_gguf), "--name", "gemma3-270m")
    assert imported.returncode == 0, imported.stderr
    result = fresh_daemon.cli("run", "smollm2", input=(
        "/set verbose\n/set format json\n/set parameter num_predict 64\n"
        "/set parameter temperature 0\nGive me a JSON object with a key 'a'.\n"
        "/set quiet\n/set noformat\n/show modelfile\n/set wordwrap\n/regen\n"
        "/load gemma3-270m\n/bye\n"),
        timeout=300)
    assert result.returncode == 0, result.stderr
    # /set verbose: the timings after the answer; /set format json: the answer parses
    assert [x.startswith("eval count:") for x in result.stderr.splitlines()].count(True) == 1
    answer = result.stdout.split("FROM ")[0].strip()
    assert answer.startswith("{"), result.stdout  # (64 tokens may cut it short)
    assert "FROM " in result.stdout  # /show modelfile
    assert "/set wordwrap is not needed here" in result.stderr
    assert "/regen needs the chat screen" in result.stderr
    # /load of a model without a chat template says what it will do with the messages
    assert "gemma3-270m has no chat template (a base model)" in result.stderr
    assert "smollm2 has no chat template" not in result.stderr
