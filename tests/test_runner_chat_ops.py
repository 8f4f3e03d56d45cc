"""The runner ops the chat layer relies on, through a real runner process: grammar in the
sampler chain (and a grammar llama.cpp rejects), the raw-prompt BOS rule behind `tokenize`,
logprobs, and embeddings in their own context."""

from __future__ import annotations

import math

import pytest
from llama_cpp import Llama
from localllm.engine.local import RunnerProcess, RunnerRequestFailed
from localllm.engine.runner.protocol import (
    Done,
    EmbedRequest,
    Failure,
    GenerationRequest,
    SamplingOptions,
    Token,
)
from localllm.planner.plan import cpu_plan


@pytest.fixture
async def runner(gemma_gguf, tmp_path):
    # Gemma adds a BOS token, so the BOS rule of raw prompts can be seen.
    r = RunnerProcess("gemma", gemma_gguf, cpu_plan(512), tmp_path / "runner.log")
    await r.start()
    yield r
    await r.stop()


async def events(runner, request) -> list:
    return [e async for e in runner.generate(request)]


async def test_grammar_constrains_and_a_rejected_one_is_a_400(runner):
    bad = await events(runner, GenerationRequest(id="a", prompt="Yes or no?",
                                                 grammar="root ::= ("))
    assert isinstance(bad[-1], Failure) and bad[-1].status == 400
    good = await events(runner, GenerationRequest(
        id="b", prompt="Is the sky blue? Answer:",
        grammar='root ::= " yes" | " no"', options=SamplingOptions(temperature=0)))
    assert isinstance(good[-1], Done) and good[-1].done_reason == "stop"
    assert "".join(e.text for e in good if isinstance(e, Token)) in (" yes", " no")


async def test_tokenize_counts_a_raw_prompt_with_one_bos(runner, gemma_gguf):
    vocab = Llama(str(gemma_gguf), vocab_only=True, verbose=False)
    text = "<start_of_turn>user\nhi<end_of_turn>\n"
    expected = len(vocab.tokenize(text.encode(), add_bos=True, special=True))
    assert await runner.count_tokens(text) == expected
    assert await runner.count_tokens("<bos>" + text) == expected  # no second BOS


async def test_logprobs_come_with_each_token(runner):
    got = await events(runner, GenerationRequest(
        id="c", prompt="1, 2, 3,", logprobs=2,
        options=SamplingOptions(temperature=0, num_predict=5)))
    entries = [lp for e in got if isinstance(e, Token) for lp in e.logprobs]
    assert len(entries) == got[-1].eval_count == 5
    assert all(e["top_logprobs"][0]["token"] == e["token"] for e in entries)


async def test_embeddings_in_their_own_context(runner):
    before = await events(runner, GenerationRequest(
        id="d", prompt="Once upon a time",
        options=SamplingOptions(temperature=0, num_predict=4)))
    result = await runner.embed(EmbedRequest(id="e", inputs=("a cat", "a dog"), dimensions=100))
    assert len(result.vectors) == 2 and all(len(v) == 100 for v in result.vectors)
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4 for v in result.vectors)
    with pytest.raises(RunnerRequestFailed) as e:
        await runner.embed(EmbedRequest(id="f", inputs=("word " * 9000,), truncate=False))
    assert e.value.status == 400
    # The generating context kept its cache: the same prompt is read from it again.
    again = await events(runner, GenerationRequest(
        id="g", prompt="Once upon a time",
        options=SamplingOptions(temperature=0, num_predict=4)))
    assert again[-1].cached_tokens > 0
    assert "".join(e.text for e in again if isinstance(e, Token)) == \
        "".join(e.text for e in before if isinstance(e, Token))
