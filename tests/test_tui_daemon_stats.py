"""What the daemon tells the chat's stats line: per-chunk runner counters and GET /api/stats."""

from __future__ import annotations

import json
import os
import urllib.request

from localllm.daemon.api.stats import plan_summary, process_rss, vram_of
from localllm.planner.plan import Plan


def chat_lines(daemon, num_predict: int) -> list[dict]:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Count to ten."}],
            "options": {"num_predict": num_predict, "temperature": 0}}
    request = urllib.request.Request(daemon.url + "/api/chat", data=json.dumps(body).encode())
    with urllib.request.urlopen(request, timeout=120) as resp:
        return [json.loads(line) for line in resp if line.strip()]


def test_every_chunk_carries_the_runners_running_totals(daemon):
    daemon.unload("smollm2")  # an earlier test's num_ctx must not be the context seen here
    lines = chat_lines(daemon, 12)
    final, chunks = lines[-1], lines[:-1]
    assert final["done"] and chunks and not any(c["done"] for c in chunks)
    counts = [c["stats"]["eval_count"] for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 12
    durations = [c["stats"]["eval_duration"] for c in chunks]
    assert durations == sorted(durations) and durations[-1] > durations[0]
    for c in chunks:
        s = c["stats"]
        # the runner's tokens read; the last line's Ollama field is the whole input
        assert s["prompt_eval_count"] == (final["prompt_eval_count"]
                                          - final["prompt_eval_cached_count"])
        assert s["context_used"] == final["prompt_tokens"] + s["eval_count"]
        assert s["context_length"] == 4096 and "draft" not in s  # no speculation: no field
    stats = final["stats"]
    assert stats["eval_count"] == final["eval_count"] == 12
    assert stats["eval_duration"] == final["eval_duration"] >= durations[-1]
    assert 0 < stats["time_to_first_token"] <= final["total_duration"]
    assert stats["time_to_first_token"] >= final["prompt_eval_duration"]


def test_stats_route_measures_the_runner(daemon):
    final = chat_lines(daemon, 6)[-1]
    entry = next(m for m in daemon.get("/api/stats")["models"]
                 if m["model"] == "smollm2:latest")
    ps = next(m for m in daemon.ps() if m["name"] == "smollm2:latest")
    assert entry["runner_pid"] == ps["runner_pid"] and not entry["busy"]
    with open(f"/proc/{entry['runner_pid']}/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    assert abs(entry["rss_bytes"] - rss_kib * 1024) < 64 << 20  # same process, moments apart
    assert entry["rss_bytes"] > 50 << 20  # a loaded 135M model
    plan = entry["plan"]
    assert plan["layers"] == 31 and 0 <= plan["gpu_layers"] <= 31  # 30 blocks + output
    assert plan["kv_type"] == ps["kv_type"] and plan["n_ctx"] == entry["context_length"]
    assert plan["reasons"]
    last = entry["last"]
    assert last["eval_count"] == 6 and last["done_reason"] == "length"
    assert entry["context_used"] == final["context_used"]
    if not os.path.exists("/dev/nvidiactl"):
        assert entry["vram_bytes"] is None and entry["vram_source"] is None


def test_vram_is_measured_or_marked_as_the_plans():
    plan = Plan(n_ctx=4096)
    assert vram_of(7, None, plan) == (None, None)  # no NVIDIA GPU
    assert vram_of(7, {7: 1 << 30, 8: 5}, plan) == (1 << 30, "nvml")
    assert vram_of(7, {8: 5}, plan) == (plan.vram_bytes(), "plan")  # NVML cannot see it
    assert process_rss(os.getpid()) > 0 and process_rss(None) is None
    assert process_rss(2 ** 22 + 12345) is None  # no such process
    assert plan_summary(Plan(n_ctx=512, n_gpu_layers=999), 30)["gpu_layers"] == 31
    assert plan_summary(Plan(n_ctx=512, n_gpu_layers=-1), 30)["gpu_layers"] == 31
