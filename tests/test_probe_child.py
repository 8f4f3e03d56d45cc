"""The engine's child program for the tuner (llama/probe.py), asked through the one parent-side
helper (profiles/tuning/probing.py): typed requests cross as they are, and a request the child
cannot serve comes back as one clear error, never a traceback or a hang. The ops themselves run
on real llama.cpp in test_synth.py (dry run), test_tuner_choose.py (measure, calibrate),
test_eval.py and test_rpc.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from localllm.profiles.planning.plan import Plan, TensorOverride
from localllm.profiles.planning.probes import (
    Calibrate,
    DryRun,
    Evaluate,
    Measure,
    RpcProbe,
    read_request,
    request_line,
)
from localllm.profiles.tuning.probing import CHILD_COMMAND, ProbeFailed, ask

PLAN = Plan(n_ctx=1024, n_gpu_layers=3, type_k="q8_0", type_v="q8_0", flash_attn=True,
            tensor_overrides=(TensorOverride("blk\\.1\\.ffn_.*", "CPU"),), rpc_workers=("h:1",))


@pytest.mark.parametrize("request_", [
    DryRun("/m.gguf", PLAN), Measure("/m.gguf", PLAN, 64, 8),
    Evaluate("/m.gguf", ("q8_0", "q4_0"), "text", 512, "/ref.gguf", "ref", 0),
    RpcProbe(("127.0.0.1:50052", "[::1]:50053")), Calibrate(1),
])
def test_every_op_crosses_the_pipe_as_the_same_value(request_):
    line = request_line(request_)
    assert json.loads(line)["op"] == request_.op
    assert read_request(line) == request_


def test_a_line_that_names_no_op_is_refused():
    with pytest.raises(ValueError, match="not a probe request"):
        read_request('{"op": "format_disk"}')
    with pytest.raises(ValueError, match="dry_run request without"):
        read_request('{"op": "dry_run", "plan": {}}')


def test_the_child_answers_a_bad_request_with_one_error_line():
    done = subprocess.run(CHILD_COMMAND, input='{"op": "nothing"}\n', capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "error": "not a probe request: '{\"op\": \"nothing\"}\\n'"}


def test_a_file_llama_cpp_cannot_load_is_a_probe_failure_with_its_reason(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ProbeFailed, match="dry-run load failed") as failed:
        ask(DryRun(str(bad), Plan(n_ctx=256)), timeout=60)
    assert not failed.value.timed_out
