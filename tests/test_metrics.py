"""GET /metrics: Prometheus text that a Prometheus parser reads, counters that move with
traffic, the loaded model and its plan, behind the API's access rules."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from metrics_scrape import scrape as _scrape
from metrics_scrape import value as _value


# Every family the issue asks for, present in each scrape (a family without samples yet, such
# as the drafts on a daemon that drafted nothing, still has its HELP and TYPE).
FAMILIES = (
    "localllm_requests", "localllm_prompt_tokens", "localllm_prompt_cached_tokens",
    "localllm_generated_tokens", "localllm_draft_tokens", "localllm_draft_accepted_tokens",
    "localllm_time_to_first_token_seconds", "localllm_decode_tokens_per_second",
    "localllm_queue_depth", "localllm_requests_in_progress", "localllm_model_loaded",
    "localllm_model_vram_bytes", "localllm_model_ram_bytes", "localllm_expert_cache_lookups",
    "localllm_expert_cache_swaps", "localllm_gpu_memory_bytes", "localllm_host_memory_bytes",
    "localllm_daemon_ram_bytes", "localllm_uptime_seconds")


def test_metrics_parse_and_move_with_traffic(daemon):
    before = _scrape(daemon.url)
    body = json.dumps({"model": "smollm2", "prompt": "Hello", "stream": False,
                       "options": {"num_predict": 6, "temperature": 0}}).encode()
    req = urllib.request.Request(daemon.url + "/api/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        done = json.loads(resp.read())
    after = _scrape(daemon.url)
    route = {"method": "POST", "route": "/api/generate", "code": "200"}
    assert _value(after, "localllm_requests", "localllm_requests_total", **route) == \
        _value(before, "localllm_requests", "localllm_requests_total", **route) + 1
    model = {"model": "smollm2:latest"}
    assert _value(after, "localllm_generated_tokens", "localllm_generated_tokens_total",
                  **model) - _value(before, "localllm_generated_tokens",
                                    "localllm_generated_tokens_total", **model) \
        == done["eval_count"]
    assert _value(after, "localllm_prompt_tokens", "localllm_prompt_tokens_total", **model) > \
        _value(before, "localllm_prompt_tokens", "localllm_prompt_tokens_total", **model)
    for family in ("localllm_time_to_first_token_seconds", "localllm_decode_tokens_per_second"):
        assert _value(after, family, f"{family}_count", **model) == \
            _value(before, family, f"{family}_count", **model) + 1, family
    assert _value(after, "localllm_decode_tokens_per_second",
                  "localllm_decode_tokens_per_second_sum", **model) > \
        _value(before, "localllm_decode_tokens_per_second",
               "localllm_decode_tokens_per_second_sum", **model)
    assert set(FAMILIES) <= set(after), set(FAMILIES) - set(after)
    loaded = [dict(k) for k in after["localllm_model_loaded"]
              if dict(k).get("model") == "smollm2:latest"]
    assert loaded and loaded[0]["context"].isdigit() and "kv_type" in loaded[0]
    assert loaded[0]["speculative"] and loaded[0]["gpu_layers"].isdigit()
    assert _value(after, "localllm_model_ram_bytes", "localllm_model_ram_bytes", **model) > 0
    assert _value(after, "localllm_model_vram_bytes", "localllm_model_vram_bytes",
                  source="plan", **model) == 0  # no GPU here: the CPU plan's figure
    assert _value(after, "localllm_requests_in_progress", "localllm_requests_in_progress",
                  **model) == 0  # the answer ended
    assert not after["localllm_gpu_memory_bytes"]  # no NVIDIA GPU on this machine
    ram = {dict(k)["kind"]: v for k, v in after["localllm_host_memory_bytes"].items()}
    assert ram["total"] >= ram["available"] > 0
    assert 0 < _value(after, "localllm_daemon_ram_bytes", "localllm_daemon_ram_bytes") \
        < ram["total"]
    # a 404 counts under its route pattern's absence, not under the raw path
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(daemon.url + "/no/such/path/123", timeout=10)
    assert not any("/no/such" in str(k) for k in _scrape(daemon.url)["localllm_requests"])


def test_metrics_are_behind_the_api_key(tmp_path):
    from daemon_process import isolated_env, start_daemon

    d = start_daemon(isolated_env(tmp_path, LOCALLLM_API_KEY="s3cret"))
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            _scrape(d.url)
        assert e.value.code == 401
        families = _scrape(d.url, {"Authorization": "Bearer s3cret"})
        assert _value(families, "localllm_requests", "localllm_requests_total",
                      method="GET", route="/metrics", code="401") >= 1
    finally:
        d.stop()
