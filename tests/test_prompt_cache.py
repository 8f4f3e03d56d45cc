"""The RAM prompt cache: a slot taken for another request keeps its prompt in RAM, and a later
request starting with it restores it instead of reading it again. Real runner processes with
real llama.cpp and models; the sequence-state module through a real context."""

from __future__ import annotations

import ctypes
import dataclasses
from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from localllm.engine.local import RunnerProcess
from localllm.engine import model as llama
from localllm.engine import state as seqstate
from localllm.engine.runner.protocol import Done, GenerationRequest, SamplingOptions
from localllm.engine.runner.reuse import PromptCache
from localllm.engine.state import SavedSequence
from localllm.planner.plan import cpu_plan

GREEDY = SamplingOptions(num_predict=8, temperature=0)
STORY = " ".join(f"Line {i}: the {['red', 'green', 'blue'][i % 3]} fox ran {i} miles."
                 for i in range(30))  # about 410 tokens: past MIN_SAVED_TOKENS many times
SIDE = "Write a five-word title for a chat about cooking pasta."


def one_slot_plan(n_ctx: int = 2048):
    return dataclasses.replace(cpu_plan(n_ctx), n_parallel=1)


async def answer(runner: RunnerProcess, prompt: str, rid: str) -> tuple[str, Done]:
    text, done = [], None
    async for event in runner.generate(GenerationRequest(id=rid, prompt=prompt,
                                                         options=GREEDY)):
        if isinstance(event, Done):
            done = event
        elif hasattr(event, "text"):
            text.append(event.text)
    assert done is not None, "no Done event"
    return "".join(text), done


@pytest.fixture
async def runner_for(tmp_path):
    started = []

    async def start(gguf: Path, cache_bytes: int, plan=None) -> RunnerProcess:
        r = RunnerProcess("m", gguf, plan or one_slot_plan(),
                          tmp_path / f"runner{len(started)}.log",
                          prompt_cache_bytes=cache_bytes)
        await r.start()
        started.append(r)
        return r

    yield start
    for r in started:
        await r.stop()


async def test_a_side_request_in_the_only_slot_does_not_cost_the_conversation_its_prompt(
        runner_for, smollm2_gguf):
    runner = await runner_for(smollm2_gguf, 256 * 2**20)
    _, first = await answer(runner, STORY, "a")
    assert first.cached_tokens == 0 and first.prompt_tokens > 300
    _, side = await answer(runner, SIDE, "side")
    assert side.cached_tokens < 5  # it shared nothing with the story
    turn2 = STORY + " Then the fox slept."
    text, second = await answer(runner, turn2, "b")
    # Restored from RAM: everything the first prompt held is reused, and counted as cached.
    assert second.cached_tokens >= first.prompt_tokens - 1
    assert second.prompt_eval_count == second.prompt_tokens - second.cached_tokens
    log = Path(runner.log_path).read_text()
    assert "prompt cache: saved" in log and "prompt cache: restored" in log

    # The restored KV is the one the slot held: the answer is the one a slot that was never
    # taken gives (same cached prefix, same chunks read after it).
    kept = await runner_for(smollm2_gguf, 256 * 2**20)
    await answer(kept, STORY, "a")
    text_kept, second_kept = await answer(kept, turn2, "b")
    assert second_kept.cached_tokens == second.cached_tokens
    assert text == text_kept


async def test_without_the_cache_the_side_request_evicts_the_prompt(runner_for, smollm2_gguf):
    runner = await runner_for(smollm2_gguf, 0)
    _, first = await answer(runner, STORY, "a")
    await answer(runner, SIDE, "side")
    _, second = await answer(runner, STORY + " Then the fox slept.", "b")
    assert second.cached_tokens < 5
    assert "prompt cache" not in Path(runner.log_path).read_text()


async def test_sliding_window_prompts_are_restored_only_where_their_window_allows(
        runner_for, gemma_gguf):
    """Gemma 3 keeps the last 512 positions of its sliding-window layers. A saved 1,300-token
    prompt can be continued from its end, but not from position 450: the window there is gone
    (the request reads everything again, as the slot rules already do)."""
    runner = await runner_for(gemma_gguf, 256 * 2**20)
    words = [f"w{i}" for i in range(400)]
    long_prompt = " ".join(words) + " end."
    _, first = await answer(runner, long_prompt, "a")
    assert first.prompt_tokens > 1100
    await answer(runner, SIDE, "side")
    _, early = await answer(runner, " ".join(words[:150]) + " Then once upon a time", "b")
    assert early.cached_tokens <= 1  # the BOS the side request's slot began with
    await answer(runner, SIDE, "side2")
    _, late = await answer(runner, long_prompt + " And then some more words.", "c")
    assert late.cached_tokens >= first.prompt_tokens - 1


def test_a_saved_sequence_restores_into_another_context_and_sequence(smollm2_gguf):
    """What a reload relies on: a sequence saved from one context goes into another sequence
    of a larger context of the same model, and the next token's logits are the same. (The
    contexts must have as many sequences: llama.cpp refuses a stream count that differs.)"""
    lm = llama.load(str(smollm2_gguf), dataclasses.replace(cpu_plan(512), n_parallel=2))
    tok = llama.Tokenizer(lm.model, lm.vocab)
    tokens = tok.tokenize("The quick brown fox jumps over the lazy dog. " * 8)
    batch = llama_cpp.llama_batch_init(len(tokens) + 1, 0, 1)

    def decode(ctx, seq: int, toks: list[int], start: int) -> np.ndarray:
        for i, t in enumerate(toks):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = seq, i == len(toks) - 1
        batch.n_tokens = len(toks)
        assert llama_cpp.llama_decode(ctx, batch) == 0
        logits = llama_cpp.llama_get_logits_ith(ctx, len(toks) - 1)
        return np.ctypeslib.as_array(logits, shape=(lm.n_vocab,)).copy()

    decode(lm.ctx, 0, tokens, 0)
    saved = seqstate.save(lm.ctx, 0, tokens)
    assert saved is not None and saved.tokens == tuple(tokens)
    assert saved.nbytes == seqstate.state_size(lm.ctx, 0)
    assert seqstate.save(lm.ctx, 0, tokens, limit=saved.nbytes - 1) is None
    expected = decode(lm.ctx, 0, [tokens[-1]], len(tokens))

    other = llama.load(str(smollm2_gguf), dataclasses.replace(cpu_plan(1024), n_parallel=2))
    assert seqstate.restore(other.ctx, 1, saved)
    assert llama_cpp.llama_memory_seq_pos_max(other.memory, 0) == -1  # seq 0 stays empty
    assert llama_cpp.llama_memory_seq_pos_max(other.memory, 1) == len(tokens) - 1
    got = decode(other.ctx, 1, [tokens[-1]], len(tokens))
    assert np.allclose(got, expected, atol=1e-3)
    llama_cpp.llama_batch_free(batch)
    for m in (lm, other):
        llama_cpp.llama_free(m.ctx)
        llama_cpp.llama_model_free(m.model)


def saved_of(tokens: list[int], nbytes: int) -> SavedSequence:
    return SavedSequence(tuple(tokens), (ctypes.c_uint8 * nbytes)(), pos_min=0)


def test_the_cache_keeps_its_budget_and_drops_the_least_recently_used():
    cache = PromptCache(1000)
    a, b, c = saved_of([1, 2, 3], 400), saved_of([4, 5, 6], 400), saved_of([7, 8], 400)
    assert cache.put(a) and cache.put(b)
    assert cache.best([1, 2, 3, 9], lambda e, n: n) == (a, 3)  # a is now the most recent
    assert cache.put(c)
    assert cache.entries == [a, c] and cache.used == 800  # b went first
    assert not cache.put(saved_of([1], 1001))  # larger than the whole budget
    assert cache.covers([7]) and not cache.covers([4, 5])


def test_a_longer_prompt_replaces_the_saved_one_it_starts_with():
    full = PromptCache(10_000)
    short, longer = saved_of([1, 2, 3], 100), saved_of([1, 2, 3, 4, 5], 150)
    full.put(short)
    full.put(longer)
    assert full.entries == [longer] and full.used == 150
    windowed = PromptCache(10_000, keep_contained=True)  # sliding window or recurrent
    windowed.put(short)
    windowed.put(longer)
    assert windowed.entries == [short, longer]
