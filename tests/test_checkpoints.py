"""Checkpoints of the recurrent and sliding-window state: a prompt that diverges from the
cached sequence behind what that state can be cut back to (an agent sending its history back
with other text in the answer's place, a line changed early in a long prompt) restarts from the
latest checkpoint before the divergence instead of reading everything again, and answers as a
cold read does. Real runner processes with real llama.cpp: a tiny synthetic Qwen3.5-style
hybrid (Gated DeltaNet blocks) and the real Gemma 3 270M (sliding-window layers); a real daemon
through the real `anthropic` and `openai` clients."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import anthropic
import openai
import pytest
from scripts import synth_gguf
from chat_models import QWEN_TOOL_TEMPLATE
from localllm.engine.local import RunnerProcess
from localllm.engine.runner.checkpoints import END, SPACED, Checkpoint, SlotCheckpoints
from localllm.engine.runner.protocol import Done, GenerationRequest, SamplingOptions
from localllm.modelstore.shape import read_shape
from localllm.planner.card import load_card
from localllm.planner.costs import model_costs
from localllm.planner.memory import (
    CHECKPOINTS_PER_SLOT,
    ContextSettings,
    checkpoint_bytes,
    memory_by_device,
)
from localllm.planner.placements import Placement
from localllm.planner.plan import cpu_plan

GREEDY = SamplingOptions(num_predict=8, temperature=0)
WORDS = " ".join(f"w{i}" for i in range(300)) + " end."
SIDE = "Write a five-word title for a chat about cooking pasta."


@pytest.fixture(scope="module")
def hybrid_gguf(tmp_path_factory) -> Path:
    """A tiny qwen35 (3 Gated DeltaNet blocks per attention block) whose every weight is drawn,
    so that its logits depend on what it read; with a chat template for the API test."""
    return synth_gguf.write_gguf(
        tmp_path_factory.mktemp("hybrid") / "qwen35-tiny.gguf",
        synth_gguf.tiny(synth_gguf.SHAPES["qwen35-27b"]), "Q8_0", "noise",
        specials=("<|im_start|>", "<|im_end|>"), chat_template=QWEN_TOOL_TEMPLATE)


@dataclasses.dataclass
class Answer:
    text: str
    logprobs: list[float]  # of each answer token
    done: Done


async def answer(runner: RunnerProcess, prompt: str, rid: str) -> Answer:
    text, logprobs, done = [], [], None
    async for event in runner.generate(GenerationRequest(id=rid, prompt=prompt, options=GREEDY,
                                                         logprobs=0)):
        if isinstance(event, Done):
            done = event
        elif hasattr(event, "text"):
            text.append(event.text)
            logprobs += [entry["logprob"] for entry in event.logprobs or ()]
    assert done is not None, "no Done event"
    return Answer("".join(text), logprobs, done)


@pytest.fixture
async def runner_for(tmp_path):
    started = []

    async def start(gguf: Path, cache_bytes: int = 0, **plan) -> RunnerProcess:
        # One thread: the runner lowers its threads while other processes hold the cores,
        # and another thread count rounds differently (warm and cold runs must not).
        plan = dataclasses.replace(cpu_plan(2048), n_parallel=1, n_threads=1,
                                   n_threads_batch=1, **plan)
        r = RunnerProcess("m", gguf, plan,
                          tmp_path / f"runner{len(started)}.log", prompt_cache_bytes=cache_bytes)
        await r.start()
        started.append(r)
        return r

    yield start
    for r in started:
        await r.stop()


def same_answer(warm: Answer, cold: Answer) -> None:
    """The same greedy text, and its logprobs equal but for the rounding of other prompt
    chunks (a checkpoint of the wrong position moves them by about 1e-2 on the
    hybrid model)."""
    assert warm.text == cold.text
    assert len(warm.logprobs) == len(cold.logprobs) > 0
    assert max(abs(a - b) for a, b in zip(warm.logprobs, cold.logprobs, strict=True)) < 1e-3


async def test_a_hybrid_model_keeps_the_prompt_when_other_text_replaces_its_answer(
        runner_for, hybrid_gguf):
    runner = await runner_for(hybrid_gguf, cache_bytes=64 * 2**20)
    first = await answer(runner, WORDS, "a")
    n1 = first.done.prompt_tokens
    assert first.done.cached_tokens == 0 and n1 > 1000
    # The next turn sends other text where the answer was: the cached sequence holds the
    # model's own answer, which a recurrent state cannot take back.
    turn2 = WORDS + " The answer, as the client renders it. Then a tool result: 42."
    second = await answer(runner, turn2, "b")
    assert (second.done.cached_tokens, second.done.cached_from, second.done.checkpoint) == \
        (n1, "checkpoint", n1)
    assert second.done.prompt_eval_count == second.done.prompt_tokens - n1  # only what is new

    # A side request takes the only slot: the conversation's checkpoints go to the prompt
    # cache with its sequence and come back with it.
    await answer(runner, SIDE, "side")
    n2 = second.done.prompt_tokens
    turn3 = turn2 + " Another rendering of the second answer. And a second tool result: 7."
    third = await answer(runner, turn3, "c")
    assert (third.done.cached_tokens, third.done.cached_from, third.done.checkpoint) == \
        (n2, "prompt cache", n2)
    assert third.done.prompt_eval_count == third.done.prompt_tokens - n2
    log = Path(runner.log_path).read_text()
    assert f"checkpoint: slot 0 at {n1} (end" in log
    assert f"prompt: {n2} tokens, {n1} kept (checkpoint at {n1})" in log
    assert f"with {CHECKPOINTS_PER_SLOT} checkpoints" in log  # the saved sequence took the slot's

    cold = await runner_for(hybrid_gguf)
    same_answer(second, await answer(cold, turn2, "cold2"))
    cold3 = await runner_for(hybrid_gguf)
    same_answer(third, await answer(cold3, turn3, "cold3"))


async def test_a_sliding_window_model_restarts_from_a_checkpoint_behind_its_window(
        runner_for, gemma_gguf):
    """Gemma 3 270M keeps the last 512 positions of its sliding-window layers (768 cells with a
    64-token micro-batch). A line changed at about token 700 of a 1,100-token prompt lies
    behind what the cache still holds: the checkpoint at 512 is restored instead, and the rest
    is read again."""
    runner = await runner_for(gemma_gguf, n_ubatch=64)
    lines = [f"Line {i}: the {['red', 'green', 'blue'][i % 3]} fox ran {i} miles."
             for i in range(80)]
    first = await answer(runner, "\n".join(lines) + "\n", "a")
    assert first.done.prompt_tokens > 1000
    lines[50] = "Line 50: the fox stopped."
    changed = "\n".join(lines) + "\n"
    second = await answer(runner, changed, "b")
    assert (second.done.cached_tokens, second.done.cached_from, second.done.checkpoint) == \
        (512, "checkpoint", 512)
    assert second.done.prompt_eval_count == second.done.prompt_tokens - 512
    cold = await runner_for(gemma_gguf, n_ubatch=64)
    same_answer(second, await answer(cold, changed, "cold"))


def test_the_api_reports_the_kept_tokens_of_a_history_with_a_changed_answer(
        tmp_path, hybrid_gguf):
    """/v1/messages and /v1/chat/completions with an earlier assistant turn that is not what
    the model said: the prompt up to that turn comes from the checkpoint at the previous
    prompt's end; usage and /api/stats say so, and the answer is a cold read's."""
    from conftest import import_models
    from daemon_process import isolated_env, start_daemon

    env = isolated_env(tmp_path / "warm", LOCALLLM_NUM_PARALLEL="1")
    import_models(env, {"hybrid": hybrid_gguf})
    daemon = start_daemon(env)
    ask = [{"role": "user", "content": WORDS}]
    history = ask + [{"role": "assistant", "content": "Not what the model said, but close."},
                     {"role": "user", "content": "Go on with the next step."}]
    try:
        client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
        create = dict(model="hybrid", max_tokens=8, extra_body={"temperature": 0})
        first = client.messages.create(messages=ask, **create)
        n1 = first.usage.input_tokens + first.usage.cache_read_input_tokens
        second = client.messages.create(messages=history, **create)
        # Kept up to the checkpoint at the first prompt's end (or NEAR_END before it, where
        # the template renders the answer's first token into the same token as the turn's
        # opening): only the history after it is read.
        assert n1 - 4 <= second.usage.cache_read_input_tokens <= n1
        last = daemon.get("/api/stats")["models"][0]["last"]
        assert last["cached_from"] == "checkpoint"
        assert last["checkpoint"] == second.usage.cache_read_input_tokens
        assert second.usage.input_tokens == last["prompt_tokens"] - last["checkpoint"]

        chat = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0)
        third = chat.chat.completions.create(
            model="hybrid", max_tokens=8, temperature=0, messages=history + [
                {"role": "assistant", "content": "Another answer than the model's."},
                {"role": "user", "content": "And the one after."}])
        n2 = last["prompt_tokens"]
        assert n2 - 4 <= third.usage.prompt_tokens_details.cached_tokens <= n2
    finally:
        daemon.stop()

    env = isolated_env(tmp_path / "cold", LOCALLLM_NUM_PARALLEL="1")
    import_models(env, {"hybrid": hybrid_gguf})
    cold_daemon = start_daemon(env)
    try:
        client = anthropic.Anthropic(base_url=cold_daemon.url, api_key="unused", max_retries=0)
        cold = client.messages.create(messages=history, **create)
        assert cold.usage.cache_read_input_tokens == 0
        assert cold.content[0].text == second.content[0].text
    finally:
        cold_daemon.stop()


def checkpoint(n: int, kind: str, nbytes: int = 100) -> Checkpoint:
    return Checkpoint(n, (ctypes.c_uint8 * nbytes)(), kind)


def test_a_slot_keeps_the_latest_prompt_end_then_spaced_checkpoints_and_drops_the_oldest():
    slot = SlotCheckpoints(limit=5)
    # a prompt's three ends (checkpoints.ends: 4 + n_ubatch and 4 before its end, the end)
    for c in (checkpoint(512, SPACED), checkpoint(1024, SPACED), checkpoint(1132, END),
              checkpoint(1196, END), checkpoint(1200, END)):
        slot.add(c)
    assert [c.n_tokens for c in slot.items] == [512, 1024, 1132, 1196, 1200]
    # The next turn's ends: the previous prompt's ends go first, the spaced ones stay.
    for n in (1332, 1396, 1400):
        slot.add(checkpoint(n, END))
    assert [c.n_tokens for c in slot.items] == [512, 1024, 1332, 1396, 1400]
    # A long read: its spaced checkpoints push out the older spaced ones, oldest first.
    slot.add(checkpoint(1912, SPACED))
    assert [c.n_tokens for c in slot.items] == [1024, 1332, 1396, 1400, 1912]
    assert slot.latest(1399).n_tokens == 1396 and slot.latest(1023) is None
    assert slot.last_at(2000) == 1912 and slot.nbytes == 500
    slot.cut(1396)  # the sequence keeps its first 1396 tokens
    assert [c.n_tokens for c in slot.items] == [1024, 1332, 1396]


def test_a_checkpoint_that_leaves_its_slot_lends_its_memory_to_the_next():
    """Copies into fresh memory pay a page fault per page (47 ms for 63 MiB on the H200): a
    dropped checkpoint's buffer is taken again, unless a saved sequence still holds it."""
    from localllm.engine import state as checkpoints

    def taken(n: int, kind: str) -> Checkpoint:
        buffer = checkpoints._buffer(4096)
        return Checkpoint(n, (ctypes.c_uint8 * 4096).from_buffer(buffer), kind, buffer=buffer)

    checkpoints._spare.clear()
    slot = SlotCheckpoints(limit=2)
    first, second = taken(10, END), taken(14, END)
    slot.add(first)
    slot.add(second)
    saved = slot.copy()  # the prompt cache keeps both: their memory is theirs for good
    third = taken(30, END)
    slot.add(third)  # pushes `first` out, which the saved sequence still holds
    assert checkpoints._spare == [] and saved[0] is first
    fourth = taken(34, END)
    slot.add(fourth)  # pushes `second` out: shared too
    assert checkpoints._spare == []
    slot.add(taken(50, END))  # pushes `third` out: nobody else holds it
    assert checkpoints._spare and checkpoints._spare[0] is third.buffer
    reused = taken(54, END)
    assert reused.buffer is third.buffer and checkpoints._spare == []
    slot.clear()  # fourth, the one at 50: both go back, at most SPARE_BUFFERS kept
    assert len(checkpoints._spare) == min(2, checkpoints.SPARE_BUFFERS)
    assert all(len(b) == 4096 for b in checkpoints._spare)
    assert checkpoints._buffer(8192) not in checkpoints._spare  # another size: fresh memory
    checkpoints._spare.clear()


def test_the_plan_counts_the_checkpoints_in_ram(tmp_path):
    """Per slot CHECKPOINTS_PER_SLOT copies of the recurrent state (hybrid) or of the window's
    cells (sliding window); none for a model of full attention only."""
    headers = synth_gguf.ensure_headers(tmp_path)
    settings = ContextSettings(n_ctx=65536, n_seq=2)
    qwen = read_shape(headers["qwen35-27b"])
    assert checkpoint_bytes(model_costs(qwen), settings) == \
        qwen.recurrent_state_bytes * CHECKPOINTS_PER_SLOT * 2
    # in the plan's RAM, beside the weights the CPU holds (not its KV: no layer reads them)
    [gpu, cpu] = memory_by_device(model_costs(qwen), Placement(66), settings,
                                  load_card("rtx3090"))
    assert cpu.overhead == checkpoint_bytes(model_costs(qwen), settings) and cpu.kv == 0
    gemma = model_costs(read_shape(headers["gemma3-27b"]))
    sliding = sum(1 for kind in gemma.kinds if kind == "sliding")
    # 1024 cells of 16 KV heads x 128 (K and V, f16) in each sliding-window layer
    assert checkpoint_bytes(gemma, settings) == \
        sliding * 1024 * 16 * 128 * 2 * 2 * CHECKPOINTS_PER_SLOT * 2
    assert checkpoint_bytes(gemma, dataclasses.replace(settings, swa_full=True)) == 0
    assert checkpoint_bytes(model_costs(read_shape(headers["llama-8b"])), settings) == 0
