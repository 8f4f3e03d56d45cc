"""One greedy answer from a runner, for tests that drive a scheduler's runners directly."""

from __future__ import annotations

from localllm.engine.runner.protocol import Done, GenerationRequest, SamplingOptions


async def answer(runner) -> Done:
    """48 tokens of a counting prompt, at temperature 0; the Done event."""
    request = GenerationRequest(id="r", prompt="Count from one to forty: one, two, three,",
                                options=SamplingOptions(num_predict=48, temperature=0))
    events = [e async for e in runner.generate(request)]
    assert isinstance(events[-1], Done), events[-1]
    return events[-1]
