"""The runner's op table (daemon/runner/protocol.py OPS): every op and every event crosses the
pipe and comes back equal, and every op names an Engine method that exists. No model: the
table and the wire alone (the runner tests drive the real engine through it)."""

from __future__ import annotations

import json
from pathlib import Path

from localllm.daemon.load import Load
from localllm.daemon.runner.engine import Engine
from localllm.daemon.runner.protocol import (
    ENDING_EVENTS,
    EVENTS,
    OPS,
    Band,
    Done,
    EmbedRequest,
    Embeddings,
    Failure,
    GenerationRequest,
    Loaded,
    Progress,
    SamplingOptions,
    Threads,
    Token,
    TokenCount,
    TokenizeRequest,
    event_from_wire,
    event_to_wire,
)
from localllm.llama.expert_cache import ExpertCacheStats
from localllm.options import LoadOptions
from localllm.profiles.planning.plan import cpu_plan

REQUESTS = (
    Load(cpu_plan(1024), LoadOptions(num_ctx=1024), (cpu_plan(512),), 1, Path("/d.gguf"), "d",
         None, 1 << 20, Path("/m.gguf")),
    GenerationRequest("g", "hi", SamplingOptions(temperature=0.0, stop=("\n",)), "root ::= x",
                      logprobs=2, prompt_logprobs=True, images=("aGk=",)),
    EmbedRequest("e", ("a cat", "a dog"), truncate=False, dimensions=64),
    TokenizeRequest("t", text="hello"),
    TokenizeRequest("u", texts=("a", "b c")),
)
EVENTS_SEEN = (
    Token("hi", 2, eval_count=3, drafted=4, draft_accepted=2,
          logprobs=({"token": "hi", "logprob": -0.5, "bytes": [104, 105],
                     "top_logprobs": []},)),
    Done("stop", 5, 10, 3, 20, 8, 3, 11, 2048, context=(1, 2, 3), stop_sequence="\n",
         prompt_logprobs=({"token": "<s>", "logprob": None, "bytes": [], "top_logprobs": [],
                           "added": True},), cached_from="slot", checkpoint=4),
    Failure("no", status=400),
    Progress(10, 20, note="band", prompt_cached=3),
    Embeddings(((0.6, 0.8), (1.0, 0.0)), prompt_tokens=4, duration_ns=7),
    TokenCount(5, (2, 3)),
    Threads(3, "busy"),
    Band(1, 2048, 0.5, 1, 0, "moved"),
    ExpertCacheStats(16, 4, 350, 294, 72, 41, 2089984, 1),  # the engine's figures as read
    Loaded(123, 5_000_000, 2048, 2, "pinned in place", {"slots": 16, "misses_on_gpu": True},
           {"text": "3 GiB locked", "locked_bytes": 3 << 30}),
)


def test_every_request_crosses_the_pipe_unchanged_under_its_op():
    by_type = {op.request: op for op in OPS}
    for request in REQUESTS:
        wire = json.loads(json.dumps(request.to_wire()))
        assert wire["op"] == by_type[type(request)].name
        assert type(request).from_wire(wire) == request


def test_every_event_crosses_the_pipe_unchanged():
    assert {type(e) for e in EVENTS_SEEN} == set(EVENTS)
    for event in EVENTS_SEEN:
        wire = json.loads(json.dumps(event_to_wire("r1", event)))
        assert wire["id"] == "r1"
        assert event_from_wire(wire) == event


def test_every_op_ends_in_a_failure_or_its_answer_and_names_an_engine_method():
    for op in OPS:
        assert Failure in op.ends and set(op.ends) <= set(ENDING_EVENTS)
        assert callable(getattr(Engine, op.method, None)), op
    assert [op.name for op in OPS if op.stream] == ["generate"]
