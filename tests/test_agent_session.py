"""An agent session replayed through the OpenAI chat completions route (tests/agent_replay.py):
with side requests between its turns, each turn after the first reads only what it added and
the rest of its prompt from the cache, with one slot (the RAM prompt cache) and with four (a
slot of its own).
Real daemons, real llama.cpp, the real `openai` client."""

from __future__ import annotations

import openai
import pytest

from agent_replay import Session, openai_chat, replay, system_prompt
from chat_models import tool_model
from daemon_process import isolated_env, start_daemon


@pytest.fixture(scope="module")
def tools_gguf(smollm2_gguf, tmp_path_factory):
    return tool_model(smollm2_gguf, tmp_path_factory.mktemp("tools"))


def session_daemon(tmp_path, tools_gguf, num_parallel: str):
    from conftest import import_models

    # SmolLM2 was trained on 8,192 tokens; the session's last turn needs about 3,400.
    env = isolated_env(tmp_path, LOCALLLM_NUM_PARALLEL=num_parallel,
                       LOCALLLM_CONTEXT_LENGTH="8192", LOCALLLM_CONTEXT_POLICY="fixed",
                       LOCALLLM_PROMPT_CACHE_RAM="512")
    import_models(env, {"smollm2-tools": tools_gguf})
    return start_daemon(env)


@pytest.mark.parametrize("num_parallel", ["1", "4"])
def test_every_turn_after_the_first_reads_from_the_cache_despite_side_requests(
        tmp_path, tools_gguf, num_parallel):
    daemon = session_daemon(tmp_path, tools_gguf, num_parallel)
    try:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", timeout=3600,
                               max_retries=0)  # a busy CI machine reads slowly
        # Three turns: two that must read from the cache, each after a side request. A shorter
        # system prompt than Claude Code's (about 2,900 tokens with the tools): what is reused is
        # the same, and the first turn reads less.
        session = Session(turns=3, system=system_prompt(words=700))
        answers = replay(openai_chat(client, "smollm2-tools"), session)
        assert answers[0].prompt_tokens > 2500  # system prompt and tools
        assert answers[0].cached_tokens < 10
        for turn, answer in enumerate(answers[1:], start=2):
            # read again: the last turn's tool call and result (about 220 tokens), no more
            read = answer.prompt_tokens - answer.cached_tokens
            assert read < 300, (
                f"turn {turn}: {answer.cached_tokens} of {answer.prompt_tokens} cached")
        # the history grew: a turn of about 220 tokens (a tool call and its result)
        assert answers[-1].prompt_tokens > answers[1].prompt_tokens + 200
        loaded = {m["model"]: m for m in daemon.get("/api/status")["loaded"]}
        assert loaded["smollm2-tools:latest"]["num_parallel"] == int(num_parallel)
        # An agent that names a model the store lacks gets a 404 that names it.
        with pytest.raises(openai.NotFoundError) as e:
            client.chat.completions.create(model="claude-sonnet-4-5", max_tokens=4,
                                           messages=[{"role": "user", "content": "hi"}])
        assert "claude-sonnet-4-5" in str(e.value)
    finally:
        daemon.stop()
