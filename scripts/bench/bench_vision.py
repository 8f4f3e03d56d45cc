#!/usr/bin/env python3
"""Images on the GPU: one 896x896 image through localllm against llama-server, and the plan with
its projector at a 12 GiB budget, in one run.

    source .device-carry/on-device.sh && python -m scripts.bench.bench_vision
    python -m scripts.bench.bench_vision --tiny      # the toy pair: check the script on a CPU

1. Writes the full-size synthetic Gemma 3 pair (scripts/synth_vision.py --shape
   gemma3-27b: the 27B language model in Q4_0 and its SigLIP projector in f16).
2. Time to the first answer token of a chat with one new 896x896 image (encode, the prompt
   read, one token), measured by the client, median of --rounds images (each new, so neither
   side reuses a cache): the localllm daemon (its own plan, the card whole) and llama-server
   with the same --mmproj, all layers on the GPU, flash attention. Target: ours at most 1.05x.
3. At a 12 GiB budget: the tuner's plan with the projector (localllm/planner/vision.py), loaded in
   this process with the projector, one image read; the peak VRAM over the baseline (NVML)
   must stay under the budget.
Prints a table and writes it to $OUT/bench_vision.md (and .json).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The carried CUDA build: the binding loads libmtmd from MTMD_CPP_LIB, not LLAMA_CPP_LIB_PATH.
if os.environ.get("LLAMA_CPP_LIB_PATH") and not os.environ.get("MTMD_CPP_LIB"):
    os.environ["MTMD_CPP_LIB"] = os.environ["LLAMA_CPP_LIB_PATH"]


import llama_cpp  # noqa: E402, F401  (the CUDA build must load before numpy)

MIB, GIB = 1 << 20, 1 << 30
QUESTION = "Describe this picture."


def png(size: int, seed: int) -> bytes:
    """An RGB PNG of size x size, a different pattern per seed (no imaging library needed)."""
    rows = bytearray()
    for y in range(size):
        rows.append(0)
        for x in range(size):
            rows += bytes(((x * 7 + seed * 31) & 255, (y * 5 + seed * 17) & 255,
                           ((x ^ y) + seed * 13) & 255))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(
            ">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(bytes(rows), 6)) + chunk(b"IEND", b""))


def chat_body(image: bytes, model: str) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return {"model": model, "max_tokens": 1, "temperature": 0, "stream": False,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": QUESTION}]}]}


def timed_chat(url: str, body: dict) -> float:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
    elapsed = time.perf_counter() - t0
    if not answer.get("choices"):
        raise RuntimeError(f"no answer: {answer}")
    return elapsed


def first_token_times(url: str, model: str, size: int, rounds: int, seed0: int) -> list[float]:
    timed_chat(url, chat_body(png(size, seed0 - 1), model))  # warm-up (load, kernels)
    return [timed_chat(url, chat_body(png(size, seed0 + i), model)) for i in range(rounds)]


# ---- the two servers -----------------------------------------------------------------------
def ours(model: Path, mmproj: Path, size: int, rounds: int) -> dict:
    from tests.daemon_process import isolated_env, start_daemon
    from localllm.modelstore.store import ModelStore

    with tempfile.TemporaryDirectory() as tmp:
        env = isolated_env(Path(tmp), LOCALLLM_NUM_PARALLEL="1",
                           LOCALLLM_CONTEXT_POLICY="fixed")
        store = ModelStore(Path(env["XDG_DATA_HOME"]) / "localllm" / "models")
        store.import_gguf(model, "vl", projector=mmproj)
        daemon = start_daemon(env)
        try:
            times = first_token_times(daemon.url, "vl", size, rounds, 100)
            [ps] = daemon.get("/api/ps")["models"]
        finally:
            daemon.stop()
    return {"times": times, "plan": f"{ps['processor']}, {ps['gpu_layers']} layers, "
                                    f"projector {ps.get('projector')}"}


def llama_server(model: Path, mmproj: Path, size: int, rounds: int) -> dict | None:
    if not shutil.which("llama-server"):
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["llama-server", "-m", str(model), "--mmproj", str(mmproj), "-ngl", "999",
           "-fa", "on", "-c", "4096", "-np", "1", "--port", str(port), "--host", "127.0.0.1"]
    log_path = Path(os.environ.get("OUT") or tempfile.gettempdir()) / "llama_server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited {proc.returncode}") from None
                time.sleep(0.5)
        times = first_token_times(url, "vl", size, rounds, 200)
    finally:
        proc.terminate()
        proc.wait()
    return {"times": times, "plan": "all layers on the GPU, -fa on"}


# ---- the 12 GiB plan -----------------------------------------------------------------------
def budget_run(model: Path, mmproj: Path, budget_gib: float, size: int) -> dict:
    """The plan at the budget, then that plan loaded with the projector in a child process
    (a clean CUDA context) reading one image, its peak VRAM measured from here."""
    from scripts.bench.bench_tuner import MemorySampler

    from localllm.engine.hardware import host_card, probe_card
    from localllm.modelstore.projector import projector_info
    from localllm.modelstore.shape import read_shape
    from localllm.planner.card import load_card
    from localllm.planner.search import Request
    from localllm.planner.vision import plan_with_projector, projector_cost
    from localllm.profiles.choose import tune_checked

    probed = probe_card()
    base = load_card(probed.name) if probed.has_gpu else load_card("h200")
    host = host_card()
    card = base.with_host(host.ram_bytes, host.cores, host.host_bandwidth_gbs).with_vram(
        budget_gib)
    shape = read_shape(model)
    request = Request(n_ctx=4096, margin_bytes=128 * MIB)
    plan = plan_with_projector(card, projector_cost(projector_info(mmproj)),
                               lambda c: tune_checked(shape, c, request, measure=True))
    child = [sys.executable, "-m", "scripts.bench.bench_vision", "--child", str(model),
             str(mmproj), str(size)]  # from the checkout's root, as this script runs
    with MemorySampler() as sampler:  # no NVML: reads 0 (a CPU check of the script)
        out = subprocess.run(child, input=json.dumps(plan.to_dict()), text=True,
                             capture_output=True, timeout=900)
    peak = sampler.delta
    if out.returncode != 0:
        raise RuntimeError(f"the budget run failed: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"budget_gib": budget_gib, "planned_vram": plan.vram_bytes(), "peak_vram": peak,
            "projector_on_gpu": plan.projector_on_gpu, "image_s_predicted":
            plan.predicted_image_s, "image_s": result["seconds"], "gpu_layers":
            plan.n_gpu_layers, "reasons": list(plan.reasons)}


def child(model: str, mmproj: str, size: int) -> int:
    """One image through the RunnerEngine with the plan on stdin; prints {"seconds": ...}."""
    from localllm.engine.runner.engine import RunnerEngine
    from localllm.engine.runner.protocol import (
        IMAGE_MARKER,
        Done,
        Failure,
        GenerationRequest,
        SamplingOptions,
    )
    from localllm.modelstore.projector import projector_info
    from localllm.planner.plan import Plan
    from localllm.planner.vision import with_room_for_images

    # the daemon's planner raises the micro-batch to one image's tokens (localllm/daemon/planner.py)
    plan = with_room_for_images(Plan.from_dict(json.loads(sys.stdin.read())),
                                projector_info(mmproj).tokens_per_image or 0)
    engine = RunnerEngine(model, plan, None, projector_path=mmproj)
    threading.Thread(target=engine.run, daemon=True).start()
    done, events = threading.Event(), []

    def emit(event):
        events.append(event)
        if isinstance(event, (Done, Failure)):
            done.set()

    prompt = f"<start_of_turn>user\n{IMAGE_MARKER}{QUESTION}<end_of_turn>\n<start_of_turn>model\n"
    image = base64.b64encode(png(size, 7)).decode()
    t0 = time.perf_counter()
    engine.submit(GenerationRequest("b", prompt, SamplingOptions(temperature=0, num_predict=1),
                                    images=(image,)), emit, threading.Event())
    done.wait(600)
    seconds = time.perf_counter() - t0
    engine.close()
    if not isinstance(events[-1], Done):
        print(f"failed: {events[-1]}", file=sys.stderr)
        return 1
    print(json.dumps({"seconds": seconds}))
    return 0


# ---- report --------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = ["| server | plan | first token after one new image (median, s) | runs |",
             "| --- | --- | --- | --- |"]
    for key in ("ours", "llama_server"):
        r = result.get(key)
        if r:
            lines.append(f"| {key} | {r['plan']} | {statistics.median(r['times']):.3f} | "
                         f"{', '.join(f'{t:.3f}' for t in r['times'])} |")
    if result.get("ours") and result.get("llama_server"):
        ratio = (statistics.median(result["ours"]["times"])
                 / statistics.median(result["llama_server"]["times"]))
        lines.append(f"\nours / llama-server: {ratio:.3f} (target <= 1.05)")
    b = result.get("budget")
    if b:
        lines += ["", f"At a {b['budget_gib']} GiB budget: {b['gpu_layers']} layers on the GPU, "
                      f"projector on the {'GPU' if b['projector_on_gpu'] else 'CPU'}; planned "
                      f"{b['planned_vram'] / MIB:.0f} MiB, peak {b['peak_vram'] / MIB:.0f} MiB "
                      f"({'under' if b['peak_vram'] <= b['budget_gib'] * GIB else 'OVER'} the "
                      f"budget); one image + first token {b['image_s']:.2f}s (predicted image "
                      f"{b['image_s_predicted']:.2f}s)",
                  *[f"- {r}" for r in b["reasons"] if not r.startswith("rejected")]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5, help="new images timed per server")
    p.add_argument("--budget", type=float, default=12.0, help="GiB for the budget plan")
    p.add_argument("--dir", type=Path, help="where the pair is written (default: a temp dir)")
    p.add_argument("--tiny", action="store_true", help="the toy pair: a CPU check of the script")
    args = p.parse_args(argv)
    from scripts import synth_vision

    directory = args.dir or Path(tempfile.mkdtemp(prefix="bench-vision-"))
    t0 = time.time()
    model, mmproj = synth_vision.write_vision_pair(directory, None if args.tiny else "gemma3-27b")
    print(f"pair written in {time.time() - t0:.0f}s: {model} ({model.stat().st_size / GIB:.1f} "
          f"GiB), {mmproj} ({mmproj.stat().st_size / MIB:.0f} MiB)", flush=True)
    size = 224 if args.tiny else 896
    result: dict = {"ours": ours(model, mmproj, size, args.rounds)}
    print(markdown(result), flush=True)
    result["llama_server"] = llama_server(model, mmproj, size, args.rounds)
    result["budget"] = budget_run(model, mmproj, 1.0 if args.tiny else args.budget, size)
    text = markdown(result)
    print(text)
    out = Path(os.environ.get("OUT") or ".")
    (out / "bench_vision.md").write_text(text + "\n")
    (out / "bench_vision.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
