"""RPC workers: real `localllm worker` processes on loopback lending their CPU to a real daemon,
which plans a model across them and this machine and answers as it does alone."""

from __future__ import annotations

from dataclasses import replace

import json
from pathlib import Path
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from conftest import import_models
from daemon_process import isolated_env, start_daemon, wait_for

from localllm.modelstore.shape import read_shape
from localllm.planner.card import load_card
from localllm.engine.probes import Worker, WorkerDevice, WorkerError
from localllm.profiles.workers import probe_workers
from localllm.profiles.rpc_plan import plan_with_workers
from localllm.planner.search import NoPlanFits, Request
from localllm.planner.tuner import tune

GREEDY = {"num_predict": 24, "temperature": 0}
PROMPT = "The three primary colours are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(port: int, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "localllm.cli", "worker", "--port",
                             str(port), "--threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("localllm worker: serving CPU on"), line + proc.stderr.read()

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_for(listening, 30, what=f"worker on port {port}")
    return proc


@pytest.fixture
def workers():
    ports = [free_port(), free_port()]
    procs = [start_worker(p) for p in ports]
    yield [f"127.0.0.1:{p}" for p in ports], procs
    for proc in procs:
        proc.kill()
        proc.wait()


def generate(daemon, options: dict) -> tuple[int, dict]:
    body = {"model": "smollm2", "prompt": PROMPT, "raw": True, "stream": False,
            "options": options}
    request = urllib.request.Request(daemon.url + "/api/generate",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_probe_reads_memory_and_measures_the_link(workers):
    endpoints, _ = workers
    found = probe_workers(endpoints)
    assert [w.endpoint for w in found] == endpoints
    for w in found:
        assert len(w.devices) == 1 and w.devices[0].total_bytes >= w.devices[0].free_bytes > 0
        assert w.link_bytes_per_s > 10e6  # loopback moves far more than 10 MB/s
        assert 1e8 < w.compute_bytes_per_s < 1e12  # a CPU reads weights at 0.1-1000 GB/s
        assert 0 < w.rtt_s < 0.5
    # A worker serves one client at a time: one that is busy is named, not waited on forever.
    with socket.create_connection(("127.0.0.1", int(endpoints[1].rsplit(":", 1)[1]))) as held:
        held.sendall(struct.pack("<BQ", 14, 24) + bytes(24))  # ggml-rpc's HELLO
        answer = b""
        while len(answer) < 36:  # 8 bytes of size, then the 28 of the answer
            part = held.recv(64)
            assert part, "the worker closed the connection at HELLO"
            answer += part
        with pytest.raises(WorkerError, match="serves one client at a time"):
            probe_workers(endpoints)
    assert len(probe_workers(endpoints)) == 2  # free again once that client is gone


def test_model_across_two_workers_answers_as_alone(tmp_path_factory, smollm2_gguf, workers):
    endpoints, procs = workers
    alone_env = isolated_env(tmp_path_factory.mktemp("alone"))
    rpc_env = isolated_env(tmp_path_factory.mktemp("rpc"),
                           LOCALLLM_RPC_WORKERS=",".join(endpoints))
    for env in (alone_env, rpc_env):
        import_models(env, {"smollm2": smollm2_gguf})
    alone = start_daemon(alone_env)
    try:
        status, expected = generate(alone, GREEDY)
        assert status == 200 and expected["response"].strip()
    finally:
        alone.stop()

    d = start_daemon(rpc_env)
    try:
        # num_gpu 20 of SmolLM2's 31 layers (30 blocks + output) leaves 11 on this CPU.
        status, got = generate(d, {**GREEDY, "num_gpu": 20})
        assert status == 200, got
        assert got["response"] == expected["response"]
        assert got["eval_count"] == expected["eval_count"]
        (model,) = d.ps()
        assert [(x["device"], x["layers"]) for x in model["devices"]] == [
            ("CPU", 11), (f"RPC[{endpoints[0]}]", 10), (f"RPC[{endpoints[1]}]", 10)]
        assert all(x["size"] > 0 for x in model["devices"])
        assert model["processor"].endswith("CPU/RPC") and model["gpu_layers"] == 20
        reasons = json.dumps(d.get("/api/stats"))  # the plan explained, as clients show it
        assert f"split: CPU: layers 0-10 (11); RPC[{endpoints[0]}]: layers 11-20 (10)" in reasons
        assert "network per token: 2 worker(s)" in reasons
        ps = d.cli("ps")
        assert ps.returncode == 0 and f"RPC[{endpoints[1]}] 10 layers" in ps.stderr

        # Layers really live on the workers: without the second one the runner that used it
        # cannot answer. The request is not lost: the daemon loads the model again, planned
        # without the worker that is gone, and answers it (or says why it cannot), and stays up.
        runner = model["runner_pid"]
        procs[1].kill()
        procs[1].wait()
        status, answer = generate(d, {**GREEDY, "num_gpu": 20})
        log = (Path(d.env["XDG_STATE_HOME"]) / "localllm" / "logs" / "localllm.log").read_text()
        if status == 200:  # its runner died before answering: loaded again, asked again
            assert answer["eval_count"] > 0
            assert f"pid {runner}" in log and "died before answering" in log
        else:  # or the runner said it could not answer
            assert status >= 500 and answer["error"]
        assert d.proc.poll() is None and d.get("/api/version")["version"]
    finally:
        d.stop()


def test_unreachable_worker_is_reported_and_the_model_runs_here(fresh_daemon, tmp_path_factory,
                                                                smollm2_gguf):
    env = isolated_env(tmp_path_factory.mktemp("gone"),
                       LOCALLLM_RPC_WORKERS=f"127.0.0.1:{free_port()}")
    import_models(env, {"smollm2": smollm2_gguf})
    d = start_daemon(env)
    try:
        status, got = generate(d, GREEDY)
        assert status == 200 and got["response"].strip()
        (model,) = d.ps()
        assert not any(x["device"].startswith("RPC") for x in model["devices"])
        assert "RPC workers not used: cannot reach RPC worker" in json.dumps(d.get("/api/stats"))
    finally:
        d.stop()
    with pytest.raises(WorkerError, match="cannot reach RPC worker"):
        probe_workers([f"127.0.0.1:{free_port()}"])


def test_worker_refuses_a_port_in_use_and_warns_off_loopback(workers):
    endpoints, _ = workers
    port = endpoints[0].rsplit(":", 1)[1]
    taken = subprocess.run([sys.executable, "-m", "localllm.cli", "worker", "--port", port],
                           capture_output=True, text=True, timeout=60)
    assert taken.returncode == 1 and "cannot listen on 127.0.0.1" in taken.stderr
    assert len(taken.stderr.strip().splitlines()) == 1
    bad = subprocess.run([sys.executable, "-m", "localllm.cli", "worker", "--device", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no device 'NOPE'" in bad.stderr and "CPU" in bad.stderr

    # Any address that is not loopback gets llama.cpp's warning: RPC has no authentication.
    open_port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "localllm.cli", "worker", "--host",
                             "0.0.0.0", "--port", str(open_port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        warning = "".join(proc.stderr.readline() for _ in range(4))
        assert "Never expose the RPC server to an open network!" in warning
    finally:
        proc.kill()
        proc.wait()


# ---- the planner, with numbers -----------------------------------------------------------------

def worker(endpoint: str, free_gib: float, link_gbs: float = 1.25, rtt_ms: float = 0.2,
           compute_gbs: float = 0.0):
    free = int(free_gib * (1 << 30))
    return Worker(endpoint, (WorkerDevice(endpoint, 0, free, free),), link_gbs * 1e9,
                  rtt_ms / 1e3, compute_gbs * 1e9)


@pytest.fixture(scope="module")
def big_shape(tmp_path_factory):
    """A 27B-class dense shape from the project's generator (sparse file: header only)."""
    from scripts import synth_gguf

    paths = synth_gguf.ensure_headers(tmp_path_factory.getbasetemp() / "synth-headers")
    return read_shape(paths["dense-27b"])


def test_plan_moves_what_the_card_cannot_hold_to_the_workers(big_shape):
    card = load_card("rtx3060-12g").with_host(64 << 30, 8, 50.0)
    request = Request(n_ctx=8192)
    local = tune(big_shape, card, replace(request, ffn_split=False))  # workers take blocks
    assert local.n_gpu_layers < big_shape.n_layer + 1  # the card alone leaves layers in RAM
    plan = plan_with_workers(big_shape, card, request,
                             [worker("a:1", 8), worker("b:2", 4)], local)
    split = dict(plan.device_layers)
    assert split["CUDA0"] == local.n_gpu_layers  # the local card keeps what it held
    assert sum(split.values()) == big_shape.n_layer + 1
    assert split["RPC[a:1]"] > split["RPC[b:2]"] > 0  # in proportion to free memory
    assert plan.tensor_split == (split["RPC[a:1]"], split["RPC[b:2]"], split["CUDA0"])
    assert plan.n_gpu_layers == split["RPC[a:1]"] + split["RPC[b:2]"] + split["CUDA0"]
    assert plan.rpc_workers == ("a:1", "b:2")
    for device in ("RPC[a:1]", "RPC[b:2]"):
        (mem,) = [m for m in plan.memory if m.device == device]
        assert mem.total <= (8 if device == "RPC[a:1]" else 4) * (1 << 30) - (512 << 20)
    # Layers off the CPU make decode faster, and a slower network makes it slower.
    assert plan.predicted_decode_tps > local.predicted_decode_tps
    slow = plan_with_workers(big_shape, card, request,
                             [worker("a:1", 8, 0.01, 5), worker("b:2", 4, 0.01, 5)], local)
    assert slow.predicted_decode_tps < plan.predicted_decode_tps
    # Workers measured at an H200's speed beat ones taken as fast as the 3060.
    fast = plan_with_workers(big_shape, card, request,
                             [worker("a:1", 8, compute_gbs=2300), worker("b:2", 4,
                                                                         compute_gbs=2300)],
                             local)
    assert fast.predicted_decode_tps > plan.predicted_decode_tps
    assert any("reads weights at 2300 GB/s" in r for r in fast.reasons)
    assert any("network per token" in r for r in plan.reasons)
    assert any(r.startswith("split: RPC[a:1]: layers 0-") and "CUDA0: layers" in r
               for r in plan.reasons)


def test_plan_says_when_even_the_workers_are_not_enough(big_shape):
    card = load_card("cpu-only")
    small = card.with_host(4 << 30, card.cores, card.host_bandwidth_gbs)
    local = tune(big_shape, load_card("cpu-only"), Request(n_ctx=4096))
    with pytest.raises(NoPlanFits, match="add a worker"):
        plan_with_workers(big_shape, small, Request(n_ctx=4096), [worker("a:1", 2)], local)


# ---- the setting -------------------------------------------------------------------------------

def test_rpc_workers_setting_from_file_env_and_command(tmp_path):
    from localllm.config import ConfigError, load_config, with_setting

    path = tmp_path / "config.toml"
    path.write_text('rpc_workers = ["10.0.0.2:50052", "gpu-box:50053"]\n')
    assert load_config(path, {}).rpc_workers == ("10.0.0.2:50052", "gpu-box:50053")
    env = {"LOCALLLM_RPC_WORKERS": "127.0.0.1:1, 127.0.0.1:2"}
    assert load_config(path, env).rpc_workers == ("127.0.0.1:1", "127.0.0.1:2")
    path.write_text('max_queue = 4\nrpc_workers = ["nohost"]\n')
    with pytest.raises(ConfigError, match=r"config.toml:2: rpc_workers: .*not host:port"):
        load_config(path, {})
    edited = with_setting("max_queue = 4\n", "rpc_workers", "a:1,b:2")
    assert 'rpc_workers = [\n    "a:1",\n    "b:2",\n]' in edited or \
        'rpc_workers = ["a:1", "b:2"]' in edited
    path.write_text(edited)
    assert load_config(path, {}).rpc_workers == ("a:1", "b:2")


def test_a_worker_slower_than_ram_is_left_out_unless_num_gpu_asks(big_shape):
    card = load_card("rtx3060-12g").with_host(64 << 30, 8, 50.0)
    request = Request(n_ctx=8192)
    local = tune(big_shape, card, replace(request, ffn_split=False))  # workers take blocks
    # "slow" reads weights at 5 GB/s over a 10 MB/s link: its layers cost more than RAM's.
    workers = [worker("fast:1", 16, compute_gbs=900), worker("slow:2", 16, 0.01, 5, 5)]
    plan = plan_with_workers(big_shape, card, request, workers, local)
    assert plan.rpc_workers == ("fast:1",)
    assert "RPC[slow:2]" not in dict(plan.device_layers)
    assert any(r.startswith("slow:2 not used: its layers would cost") for r in plan.reasons)
    forced = plan_with_workers(big_shape, card, Request(n_ctx=8192, n_gpu_layers=999), workers,
                               local)
    assert forced.rpc_workers == ("fast:1", "slow:2")
    assert forced.predicted_decode_tps < plan.predicted_decode_tps
