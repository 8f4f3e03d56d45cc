"""GET /metrics: Prometheus text that a Prometheus parser reads, counters that move with
traffic, the loaded model and its plan, behind the API's access rules."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families


def _scrape(url: str, headers: dict | None = None) -> dict[str, dict]:
    req = urllib.request.Request(url + "/metrics", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {f.name: {tuple(sorted(s.labels.items())) + ((("__name__", s.name),)): s.value
                     for s in f.samples} for f in text_string_to_metric_families(text)}


def _value(families, family: str, sample: str, **labels) -> float:
    key = tuple(sorted({**labels, "__name__": sample}.items()))
    return {tuple(sorted(k)): v for k, v in families.get(family, {}).items()}.get(key, 0.0)


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
    ttft_count = _value(after, "localllm_time_to_first_token_seconds",
                        "localllm_time_to_first_token_seconds_count", **model)
    assert ttft_count >= 1
    loaded = [dict(k) for k in after["localllm_model_loaded"]
              if dict(k).get("model") == "smollm2:latest"]
    assert loaded and loaded[0]["context"].isdigit() and "kv_type" in loaded[0]
    assert _value(after, "localllm_model_ram_bytes", "localllm_model_ram_bytes", **model) > 0
    assert "localllm_queue_depth" in after
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
