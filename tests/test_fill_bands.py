"""Fill bands: a runner starts in a small context's plan and moves to the next band's plan when a
sequence outgrows it, carrying the KV over (llama.cpp's sequence state), or, when a request's
prompt and answer room pass the band, as that request starts. Real runner processes with real
llama.cpp and the real SmolLM2 model."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from localllm.engine.local import RunnerProcess
from localllm.engine.runner.protocol import Done, GenerationRequest, Progress, SamplingOptions
from localllm.planner.plan import cpu_plan

NEAR_TIE = 0.05  # as tests/test_speculation.py: a logprob gap rounding may break either way
BAND = 512
# The mid-answer tests: an answer longer than the room a request starts with (512 tokens at
# most) still crosses its band while it is written; no room makes this short one do so.
NO_ROOM = "LOCALLLM_BAND_ANSWER_ROOM"
# About 460 tokens: the answer of 200 crosses the 512-token band while it is being written. A
# count has no near-tie to break, and a sequence whose KV did not come over would lose it.
PROMPT = "Here is a list of facts about the sea. " + " ".join(
    f"Fact {i}: the {['cold', 'deep', 'blue', 'salty'][i % 4]} water holds {i * 7} fish."
    for i in range(30)) + " Now count from 1 to 200: 1, 2, 3, 4, 5,"


def whole_plan(**changes):
    return dataclasses.replace(cpu_plan(2048), n_parallel=1, **changes)


async def greedy(runner: RunnerProcess, rid: str = "a") -> tuple[list[str], list, Done, list]:
    pieces, tops, notes, done = [], [], [], None
    request = GenerationRequest(id=rid, prompt=PROMPT, logprobs=2,
                                options=SamplingOptions(num_predict=200, temperature=0))
    async for event in runner.generate(request):
        if isinstance(event, Done):
            done = event
        elif isinstance(event, Progress):
            notes.append(event.note)
        elif event.logprobs:
            for entry in event.logprobs:
                pieces.append(entry["token"])
                tops.append([t["logprob"] for t in entry["top_logprobs"]])
    assert done is not None, "no Done event"
    return pieces, tops, done, notes


@pytest.fixture
async def runner_for(tmp_path):
    started = []

    async def start(plan, bands=(), start_band=0) -> RunnerProcess:
        r = RunnerProcess("m", started_gguf[0], plan, tmp_path / f"runner{len(started)}.log",
                          bands=bands, start_band=start_band)
        await r.start()
        started.append(r)
        return r

    started_gguf: list[Path] = []
    yield lambda gguf: started_gguf.append(gguf) or start
    for r in started:
        await r.stop()


def exact_until(tops: list[list[float]]) -> int:
    """Tokens before the first near-tie (where the band switch may round the other way)."""
    for i, top in enumerate(tops):
        if len(top) > 1 and abs(top[0] - top[1]) < NEAR_TIE:
            return i + 1
    return len(tops)


async def test_a_band_switch_mid_answer_keeps_the_greedy_text(runner_for, smollm2_gguf,
                                                             monkeypatch):
    monkeypatch.setenv(NO_ROOM, "0")
    start = runner_for(smollm2_gguf)
    whole = whole_plan()
    banded = await start(whole, bands=(dataclasses.replace(whole, n_ctx=BAND),))
    assert banded.n_ctx == 2048  # a request may use the whole context from the start
    pieces, tops, done, notes = await greedy(banded)
    assert done.prompt_tokens < BAND < done.prompt_tokens + done.eval_count, \
        "the answer must cross the band while it is written"
    assert banded.band == 1 and len(banded.band_pauses) == 1 and banded.band_pauses[0] > 0
    assert banded.running_plan.n_ctx == 2048
    assert any("moving to the 2048-token band" in n for n in notes), notes
    log = Path(banded.log_path).read_text()
    assert "band: a sequence needs" in log and "carried 1 sequences" in log
    assert "tokens read again" not in log  # (not "thread again" of a thread line)

    plain = await start(whole)
    reference, ref_tops, ref_done, _ = await greedy(plain)
    n = exact_until(ref_tops)
    assert n > BAND - done.prompt_tokens + 16, f"a near-tie at token {n}: this tests little"
    assert pieces[:n] == reference[:n]
    assert done.eval_count == ref_done.eval_count == 200
    assert done.prompt_eval_count == ref_done.prompt_eval_count  # no prompt was read twice


async def test_a_band_with_another_kv_type_reads_the_sequence_again(runner_for, smollm2_gguf,
                                                                   monkeypatch):
    monkeypatch.setenv(NO_ROOM, "0")
    start = runner_for(smollm2_gguf)
    whole = whole_plan(type_k="q8_0", type_v="q8_0")
    small = dataclasses.replace(whole, n_ctx=BAND, type_k="f16", type_v="f16")
    runner = await start(whole, bands=(small,))
    pieces, _, done, _ = await greedy(runner)
    assert runner.band == 1 and done.done_reason == "length" and done.eval_count == 200
    # The count goes on past the switch: the KV read again holds the prompt and the answer.
    numbers = [int(x) for x in "".join(pieces).split(",")[:-1]]
    assert len(numbers) > 40 and numbers[:40] == list(range(6, 46))
    # The sequence's own KV read again is no part of the prompt's counters.
    assert done.prompt_eval_count == done.prompt_tokens
    log = Path(runner.log_path).read_text()
    assert "carried 0 sequences" in log and "tokens read again: the KV type changed" in log


def test_a_switch_under_four_requests_loses_none_and_ps_shows_it(tmp_path, smollm2_gguf):
    from concurrent.futures import ThreadPoolExecutor

    import ollama
    from conftest import import_models
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path / "d", LOCALLLM_FILL_BANDS=str(BAND), LOCALLLM_NUM_PARALLEL="4",
                       **{NO_ROOM: "0"})
    import_models(env, {"smollm2": smollm2_gguf})
    daemon = start_daemon(env)
    try:
        client = ollama.Client(host=daemon.url)

        def count(i: int):
            return client.generate(model="smollm2", prompt=PROMPT, raw=True,
                                   options={"num_predict": 200, "temperature": 0, "seed": i})

        # A short request loads the model: it starts in the small band (a prompt that needs
        # more would have loaded the whole context's plan at once).
        client.generate(model="smollm2", prompt="Hello", options={"num_predict": 2})
        assert daemon.ps()[0]["fill_band"]["n_ctx"] == BAND
        small = daemon.get("/api/stats")["models"][0]["plan"]  # the band's plan, as loaded
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(count, range(4)))
        for answer in answers:
            numbers = [int(x) for x in answer.response.split(",")[:-1]]
            assert answer.eval_count == 200 and numbers[:40] == list(range(6, 46))
        [loaded] = daemon.ps()
        band = loaded["fill_band"]
        assert band["bands"] == [BAND, loaded["context_length"]] and band["n_ctx"] > BAND
        assert len(band["switch_pauses"]) == 1 and band["switch_pauses"][0] > 0
        assert loaded["num_parallel"] == 4
        stats = daemon.get("/api/stats")["models"][0]
        assert stats["fill_band"] == band and stats["plan"]["n_ctx"] == band["n_ctx"]
        listed = daemon.cli("ps")
        assert listed.returncode == 0
        assert f"fill band: up to {band['n_ctx']} tokens" in listed.stderr
        # tune shows the bands this daemon loads, each with its own curve and prompts
        tuned = daemon.cli("tune", "smollm2", "--ctx", str(loaded["context_length"]),
                           "--no-save")
        assert tuned.returncode == 0, tuned.stderr
        shown = [int(n) for n in re.findall(r"^  up to (\d+) \(", tuned.stdout, re.M)]
        assert shown == band["bands"], tuned.stdout
        assert " 0.0 at " not in tuned.stdout, tuned.stdout
        curve = dict(small["predicted_decode_by_depth"])
        line = next(ln for ln in tuned.stdout.splitlines() if ln.startswith(f"  up to {BAND} "))
        assert (f"ubatch {small['n_ubatch']}; decode {curve[0]:.1f} tok/s at the start, "
                f"{curve[BAND]:.1f} at {BAND}") in line, (line, small)
        log = (Path(env["XDG_STATE_HOME"]) / "localllm" / "logs" / "runner.log").read_text()
        assert "carried 4 sequences" in log
    finally:
        daemon.stop()


async def test_a_request_whose_answer_would_cross_the_band_moves_it_before_its_first_token(
        runner_for, smollm2_gguf):
    """The default: the prompt (about 460 tokens) and its 200-token answer pass the 512-token
    band, so the runner moves up as the request starts: the reload's note comes before the
    first token, nothing is carried (nothing was read yet), and the answer is the plain
    runner's."""
    start = runner_for(smollm2_gguf)
    whole = whole_plan()
    runner = await start(whole, bands=(dataclasses.replace(whole, n_ctx=BAND),))
    order, text, done = [], "", None
    request = GenerationRequest(id="a", prompt=PROMPT,
                                options=SamplingOptions(num_predict=200, temperature=0))
    async for event in runner.generate(request):
        if isinstance(event, Done):
            done = event
        elif isinstance(event, Progress):
            order.append("note" if "moving to the 2048-token band" in (event.note or "")
                         else "progress")
        elif event.text:
            order.append("token")
            text += event.text
    assert done is not None and done.eval_count == 200
    assert done.prompt_tokens < BAND < done.prompt_tokens + done.eval_count
    assert "note" in order and order.index("note") < order.index("token"), order
    assert runner.band == 1 and len(runner.band_pauses) == 1
    log = Path(runner.log_path).read_text()
    assert "carried 0 sequences" in log and "tokens read again" not in log
    assert done.prompt_eval_count == done.prompt_tokens  # the prompt was read once
    pieces, _, _, _ = await greedy(await start(whole))
    assert text == "".join(pieces)


def test_the_request_that_loads_the_model_picks_its_band():
    from localllm.daemon.scheduler import first_band

    whole = whole_plan()
    bands = (dataclasses.replace(whole, n_ctx=8192), dataclasses.replace(whole, n_ctx=32768))
    assert first_band(bands, len("Hello there.")) == 0
    assert first_band(bands, 60_000) == 1  # an agent's 20K-token first prompt
    assert first_band(bands, 400_000) == 2  # past the last band: the whole context's plan
    assert first_band((), 400_000) == 0


async def test_a_runner_told_to_start_in_the_last_band_never_switches(runner_for, smollm2_gguf):
    start = runner_for(smollm2_gguf)
    whole = whole_plan()
    runner = await start(whole, bands=(dataclasses.replace(whole, n_ctx=BAND),), start_band=1)
    assert runner.running_plan.n_ctx == 2048
    _, _, done, notes = await greedy(runner)
    assert done.eval_count == 200 and runner.band == 1 and runner.band_pauses == []
    assert not any(notes) and "band:" not in Path(runner.log_path).read_text()


async def short_answer(runner: RunnerProcess, rid: str) -> tuple[str, list[str]]:
    text, notes = "", []
    request = GenerationRequest(id=rid, prompt="The capital of France is",
                                options=SamplingOptions(num_predict=12, temperature=0))
    async for event in runner.generate(request):
        if isinstance(event, Progress):
            notes.append(event.note)
        elif not isinstance(event, Done):
            text += event.text
    return text, notes


async def test_a_band_unneeded_for_a_while_is_left_as_the_next_request_starts(
        runner_for, smollm2_gguf, monkeypatch):
    """After a long answer moved the runner up, a short request of another conversation moves
    it back down once the big band has gone unneeded for the wait (0 s here), with the same
    answer as a runner that never had bands; with the default wait (minutes) it stays."""
    start = runner_for(smollm2_gguf)
    whole = whole_plan()
    bands = (dataclasses.replace(whole, n_ctx=BAND),)
    staying = await start(whole, bands=bands)
    await greedy(staying)
    assert staying.band == 1
    expected, notes = await short_answer(await start(whole), "plain")
    text, notes = await short_answer(staying, "short")
    assert (text, staying.band, len(staying.band_pauses)) == (expected, 1, 1)

    monkeypatch.setenv("LOCALLLM_BAND_DOWN_AFTER_S", "0")
    leaving = await start(whole, bands=bands)
    await greedy(leaving)
    assert leaving.band == 1 and len(leaving.band_pauses) == 1
    text, notes = await short_answer(leaving, "short")
    assert text == expected
    assert leaving.band == 0 and len(leaving.band_pauses) == 2
    assert any(re.search(r"no sequence has needed the 2048-token band for \d+ s: moving to "
                         r"the 512-token band's plan", n or "") for n in notes), notes
    pieces, _, done, _ = await greedy(leaving, "again")  # and up again when it needs it
    assert leaving.band == 1 and done.eval_count == 200
