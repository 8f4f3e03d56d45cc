"""The tuner's ops in the engine's one child program, the runner (engine/runner/tuner_ops.py),
asked through the one parent-side helper (localllm/engine/probing.py): typed requests cross the
runner's op table as they are, and a request the child cannot serve comes back as one clear
Failure, never a traceback or a hang. Each request and result crosses the pipe unchanged in
test_runner_ops.py; the ops themselves run on real llama.cpp in test_synth.py (dry run),
test_tuner_choose.py (measure, calibrate), test_eval.py and test_rpc.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from localllm.engine.local import RUNNER_COMMAND
from localllm.engine.runner.protocol import Failure, event_from_wire
from localllm.planner.plan import Plan
from localllm.engine.probes import DryRun
from localllm.engine.probing import ProbeFailed, ask


def test_the_runner_refuses_a_first_line_that_names_no_op_it_starts_with():
    for line in ('{"op": "nothing", "id": ""}', '{"op": "tokenize", "id": "", "text": "x"}',
                 "not json"):
        done = subprocess.run(RUNNER_COMMAND, input=line + "\n", capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 2
        answer = event_from_wire(json.loads(done.stdout.strip().splitlines()[-1]))
        assert answer == Failure(f"not an op a runner starts with: {line + chr(10)!r}", 400)


def test_a_request_without_what_it_needs_is_one_failure():
    done = subprocess.run(RUNNER_COMMAND, input='{"op": "dry_run", "id": "", "plan": {}}\n',
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    answer = event_from_wire(json.loads(done.stdout.strip().splitlines()[-1]))
    assert isinstance(answer, Failure) and answer.status == 400
    assert answer.message.startswith("a dry_run request without what it needs")


def test_a_file_llama_cpp_cannot_load_is_a_probe_failure_with_its_reason(tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(ProbeFailed, match="dry-run load failed") as failed:
        ask(DryRun(str(bad), Plan(n_ctx=256)), timeout=60)
    assert not failed.value.timed_out
