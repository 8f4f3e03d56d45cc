"""Issue 21, the past-RAM tier: a plan whose CPU weights exceed its RAM budget locks the part RAM
holds and streams the rest from the model file (engine/resident.py), and says so in /api/ps."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from scripts import synth_gguf

from conftest import import_models
from daemon_process import isolated_env, start_daemon
from localllm.engine.resident import TOKEN_TABLE, cpu_tensors, page_ranges, split_resident
from localllm.modelstore.gguf_header import read_header
from localllm.planner.plan import Plan, TensorOverride

MIB = 1 << 20


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return {name: read_header(path) for name, path in paths.items()}


def block_of(name: str) -> int | None:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def test_the_cpu_tensors_are_those_the_plan_leaves_on_the_cpu(headers):
    header = headers["dense-27b"]  # an lm-head of its own
    n_layer = header.metadata[f"{header.metadata['general.architecture']}.block_count"]
    plan = Plan(n_ctx=4096, n_gpu_layers=40, device_layers=(("CPU", 25), ("CUDA0", 40)),
                tensor_overrides=(TensorOverride(r"^blk\.(40|41)\.ffn_(up|gate|down)\.", "CPU"),))
    spans, row_read = cpu_tensors(header, plan)
    names = {s.name for s in spans}
    whole = {block_of(n) for n in names if block_of(n) is not None and "ffn" not in n}
    assert whole == set(range(n_layer + 1 - 40)), "blocks below llama.cpp's i_gpu_start"
    assert {n for n in names if block_of(n) in (40, 41)} == {
        f"blk.{i}.ffn_{p}.weight" for i in (40, 41) for p in ("up", "gate", "down")}
    assert TOKEN_TABLE in names and "output.weight" not in names  # the lm-head is on the GPU
    assert row_read == {TOKEN_TABLE}
    by_name = {t.name: t for t in header.tensors}
    for s in spans:
        assert s.end - s.start == by_name[s.name].n_bytes
        assert s.start == header.data_offset + by_name[s.name].offset


def test_a_tied_token_table_that_is_the_cpu_lm_head_is_read_whole(headers):
    header = headers["llama-1b"]  # tied embeddings
    n_layer = header.metadata["llama.block_count"]
    spans, row_read = cpu_tensors(header, Plan(n_ctx=512, n_gpu_layers=0))
    assert {block_of(s.name) for s in spans if block_of(s.name) is not None} == set(
        range(n_layer))
    assert row_read == set(), "every token reads all of it as the lm-head"
    on_gpu = Plan(n_ctx=512, n_gpu_layers=n_layer + 1, device_layers=(("CUDA0", n_layer + 1),))
    spans, row_read = cpu_tensors(header, on_gpu)
    assert [s.name for s in spans] == [TOKEN_TABLE] and row_read == {TOKEN_TABLE}
    # the lm-head kept in RAM by the tuner's override: the token table is read whole again
    head_in_ram = Plan(n_ctx=512, n_gpu_layers=n_layer + 1, device_layers=(("CUDA0", n_layer + 1),),
                       tensor_overrides=(TensorOverride(r"^token_embd\.weight$", "CPU"),))
    spans, row_read = cpu_tensors(header, head_in_ram)
    assert [s.name for s in spans] == [TOKEN_TABLE] and row_read == set()


def test_the_stream_takes_row_read_tensors_then_the_last_blocks(headers):
    header = headers["dense-27b"]
    plan = Plan(n_ctx=4096, n_gpu_layers=40, device_layers=(("CPU", 25), ("CUDA0", 40)))
    spans, row_read = cpu_tensors(header, plan)
    want = 3 << 30
    resident, streamed = split_resident(spans, want, row_read)
    assert streamed[0].name == TOKEN_TABLE
    total = sum(s.end - s.start for s in streamed)
    assert want <= total < want + max(s.end - s.start for s in spans)
    assert {s.name for s in resident} | {s.name for s in streamed} == {s.name for s in spans}
    assert min(block_of(s.name) for s in streamed[1:]) >= max(
        block_of(s.name) for s in resident if block_of(s.name) is not None)
    ranges = page_ranges(resident)
    assert all(a < b for a, b in ranges) and all(
        ranges[i][1] < ranges[i + 1][0] for i in range(len(ranges) - 1)), "merged, in order"
    assert sum(b - a for a, b in ranges) >= sum(s.end - s.start for s in resident)


def vm_locked_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmLck:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_daemon_past_its_ram_budget_locks_what_ram_holds_and_ps_says_so(tmp_path):
    # The 1B shape with random weights (0.7 GiB): RAM budgets start at 256M, and the smaller
    # test models' plans need no more than that
    model = synth_gguf.ensure_model(tmp_path / "models", synth_gguf.SHAPES["llama-1b"])
    env = isolated_env(tmp_path / "d", LOCALLLM_RAM_BUDGET="800MiB",
                       LOCALLLM_CONTEXT_LENGTH="512", LOCALLLM_CONTEXT_POLICY="fixed")
    import_models(env, {"big": model})
    d = start_daemon(env)
    try:
        body = json.dumps({"model": "big", "prompt": "The quick brown fox", "raw": True,
                           "stream": False, "options": {"num_predict": 8, "temperature": 0}})
        request = urllib.request.Request(f"{d.url}/api/generate", data=body.encode())
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())
        assert answer["eval_count"] >= 1
        loaded = d.get("/api/ps")["models"][0]
        past = loaded["past_ram"]
        model_bytes = model.stat().st_size
        assert 0 < past["streamed_bytes"] < model_bytes, past
        locked = vm_locked_bytes(loaded["runner_pid"])
        if "RLIMIT_MEMLOCK" in past["text"]:  # an unprivileged user's limit stopped it
            assert locked == past["locked_bytes"], (locked, past)
        else:
            assert past["locked_bytes"] > 0 and locked >= past["locked_bytes"], (locked, past)
            assert past["locked_bytes"] + past["streamed_bytes"] <= model_bytes + 64 * MIB
        assert f"{past['locked_bytes'] / (1 << 30):.1f} GiB of the weights locked" in past["text"]
    finally:
        d.stop()
