"""The benchmarks' settings for our daemon (bench_systems.daemon_settings): a setting exported
to the command reaches the daemon (its environment is made anew, without the caller's
LOCALLLM_ variables), the harness's own do not move, and a system's own setting wins."""

from __future__ import annotations

from argparse import Namespace

from scripts.bench.bench_session import ours_settings
from scripts.bench.bench_systems import daemon_settings

HARNESS = {"LOCALLLM_CONTEXT_LENGTH": "32768", "LOCALLLM_NUM_PARALLEL": "1"}


def test_exported_settings_reach_ours_daemon(monkeypatch):
    monkeypatch.setenv("LOCALLLM_KV_CACHE_TYPE", "f16")
    monkeypatch.setenv("LOCALLLM_EXPERT_CACHE", "off")
    monkeypatch.setenv("LOCALLLM_CONTEXT_LENGTH", "4096")  # the harness's: --ctx decides
    monkeypatch.setenv("LOCALLLM_NOT_A_SETTING", "1")
    monkeypatch.setenv("LOCALLLM_HOST", "0.0.0.0:11434")  # the harness's daemon takes any port
    args = Namespace(expert_cache=64)
    assert daemon_settings(HARNESS, ours_settings("ours", args)) == HARNESS | {
        "LOCALLLM_KV_CACHE_TYPE": "f16", "LOCALLLM_EXPERT_CACHE": "off"}
    assert daemon_settings(HARNESS, ours_settings("ours-cache", args)
                           )["LOCALLLM_EXPERT_CACHE"] == "64"
    assert daemon_settings(HARNESS, ours_settings("ours-misses-cpu", args)) == HARNESS | {
        "LOCALLLM_KV_CACHE_TYPE": "f16", "LOCALLLM_EXPERT_CACHE": "off",
        "LOCALLLM_EXPERT_MISSES": "cpu"}
