"""The runner's op table (engine/runner/protocol.py OPS): every op and every event crosses the
pipe and comes back equal, and every op names an RunnerEngine method that exists (a tuner's op, one
of tuner_ops.py). No model: the
table and the wire alone (the runner tests drive the real engine through it)."""

from __future__ import annotations

import json
from pathlib import Path

from localllm.engine.expert_cache import ExpertCacheStats
from localllm.engine.runner import tuner_ops
from localllm.engine.runner.engine import RunnerEngine
from localllm.engine.runner.load import Load
from localllm.engine.runner.protocol import (
    ENDING_EVENTS,
    EVENTS,
    OPS,
    Band,
    Done,
    Embeddings,
    EmbedRequest,
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
    request_to_wire,
)
from localllm.planner.plan import Plan, TensorOverride, cpu_plan
from localllm.engine.probes import (
    Bandwidth,
    Buffers,
    Calibrate,
    Chunks,
    DryRun,
    EvalResult,
    Evaluate,
    Evaluation,
    KernelRates,
    Measure,
    Measurement,
    RpcProbe,
    TimeKernels,
    Worker,
    WorkerDevice,
    Workers,
)

from localllm.options import LoadOptions

PLAN = Plan(n_ctx=1024, n_gpu_layers=3, type_k="q8_0", type_v="q8_0", flash_attn=True,
            tensor_overrides=(TensorOverride("blk\\.1\\.ffn_.*", "CPU"),), rpc_workers=("h:1",))
REQUESTS = (
    Load(cpu_plan(1024), LoadOptions(num_ctx=1024), (cpu_plan(512),), 1, Path("/d.gguf"), "d",
         None, 1 << 20, Path("/m.gguf")),
    GenerationRequest("g", "hi", SamplingOptions(temperature=0.0, stop=("\n",)), "root ::= x",
                      logprobs=2, prompt_logprobs=True, images=("aGk=",)),
    EmbedRequest("e", ("a cat", "a dog"), truncate=False, dimensions=64),
    EmbedRequest("r", ("a cat", "a dog"), query="which is a pet?"),
    TokenizeRequest("t", text="hello"),
    TokenizeRequest("u", texts=("a", "b c")),
    DryRun("/m.gguf", PLAN), Measure("/m.gguf", PLAN, 64, 8),
    Evaluate("/m.gguf", ("q8_0", "q4_0"), "text", 512, "/ref.gguf", "ref", 0),
    RpcProbe(("127.0.0.1:50052", "[::1]:50053")), Calibrate(1),
    TimeKernels((1, 8, 16), ("Q4_0", "MXFP4"), 64 << 20),
)
EVENTS_SEEN = (
    Token("hi", 2, eval_count=3, drafted=4, draft_accepted=2,
          logprobs=({"token": "hi", "logprob": -0.5, "bytes": [104, 105],
                     "top_logprobs": []},)),
    Done("stop", 5, 10, 3, 20, 8, 3, 11, 2048, context=(1, 2, 3), stop_sequence="\n",
         prompt_logprobs=({"token": "<s>", "logprob": None, "bytes": [], "top_logprobs": [],
                           "added": True},), cached_from="slot", checkpoint=4),
    Failure("no", status=400),
    Failure("the prompt is 600 tokens", status=400, context_exceeded=(600, 512)),
    Progress(10, 20, note="band", prompt_cached=3),
    Embeddings(((0.6, 0.8), (1.0, 0.0)), prompt_tokens=4, duration_ns=7),
    TokenCount(5, (2, 3)),
    Threads(3, "busy"),
    Band(1, 2048, 0.5, 1, 0, "moved"),
    ExpertCacheStats(16, 4, 350, 294, 72, 41, 2089984, 1),  # the engine's figures as read
    Loaded(123, 5_000_000, 2048, 2, "pinned in place", {"slots": 16, "misses_on_gpu": True},
           {"text": "3 GiB locked", "locked_bytes": 3 << 30}),
    Buffers({"CUDA0": 5, "CPU": 7}, 3, 1), Measurement(10.5, 2.5, 9, 128, 32, 0.5, {"hits": 3}),
    Evaluation((EvalResult("q8_0", "f16", 0.1, 0.2, 0.9, 7.5, 7.4, 100),)),
    Workers((Worker("h:1", (WorkerDevice("h:1", 0, 5, 9),), 1e9, 0.001, 2e9),)),
    Bandwidth(3000.0, 25.0), KernelRates((("Q4_0", 1, 9.5), ("Q4_0", 16, 61.2))), Chunks(2, 5),
)


def test_every_request_crosses_the_pipe_unchanged_under_its_op():
    by_type = {op.request: op for op in OPS}
    for request in REQUESTS:
        to_wire = getattr(request, "to_wire", None)  # the daemon's requests spell themselves
        wire = json.loads(json.dumps(to_wire() if to_wire else request_to_wire(request)))
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
        server = (tuner_ops.METHODS.get(op.method) if op.alone
                  else getattr(RunnerEngine, op.method, None))
        assert callable(server), op
    assert [op.name for op in OPS if op.stream] == ["generate"]
    assert [op.name for op in OPS if op.alone] == ["dry_run", "measure", "evaluate", "rpc_probe",
                                                   "calibrate", "kernel_rates"]
