"""Crash notes are the crashed model's alone, and about the setting that crashed (issue 68, item
5): dropped when the setting did not help, never counting a SIGKILL from outside (the OOM killer,
`kill -9`), shown by `ps` and dropped by `localllm ps --forget-crashes`; an engine built with
AMX on an AMX CPU starts without the extra buffer types and says why."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import import_models
from daemon_process import isolated_env, start_daemon, wait_for
from test_engine_cpu import _daemon_log, _generate

from localllm.daemon.crashes import CRASHES_BEFORE_SAFER, Crashes
from localllm.engine.cpu import amx_hazard
from localllm.planner.plan import Plan

RETRY = "retrying with llama.cpp's extra buffer types (repack, AMX) off"
RISKY = Plan(n_ctx=8192, expert_cache=512, expert_misses_on_gpu=True)


def test_a_sigkill_from_outside_is_not_the_engines_crash(tmp_path):
    crashes = Crashes()
    for _ in range(CRASHES_BEFORE_SAFER + 1):
        crashes.record("m", RISKY, "killed by SIGKILL", tmp_path / "log", -signal.SIGKILL)
    assert crashes.safer("m", RISKY, ()) == (RISKY, ()), "loaded as planned"
    assert not crashes.note("m")


def test_a_setting_that_did_not_help_is_on_again_and_notes_can_be_dropped(tmp_path):
    crashes = Crashes()
    for _ in range(CRASHES_BEFORE_SAFER):
        crashes.record("m", RISKY, "killed by SIGSEGV", tmp_path / "log", -signal.SIGSEGV)
        crashes.record("other", RISKY, "killed by SIGSEGV", tmp_path / "log", -signal.SIGSEGV)
    plan, _ = crashes.safer("m", RISKY, ())
    assert not plan.expert_misses_on_gpu and "misses off" in crashes.note("m")
    for _ in range(CRASHES_BEFORE_SAFER):  # the pool next
        crashes.record("m", plan, "killed by SIGSEGV", tmp_path / "log", -signal.SIGSEGV)
    plan, _ = crashes.safer("m", RISKY, ())
    assert plan.expert_cache == 0 and "pool off" in crashes.note("m")
    # It crashes with both off too: neither was the cause, both are on at the next load
    crashes.record("m", plan, "killed by SIGSEGV", tmp_path / "log", -signal.SIGSEGV)
    assert crashes.safer("m", RISKY, ()) == (RISKY, ()) and not crashes.note("m")
    # another model's notes are its own, until dropped
    assert not crashes.safer("other", RISKY, ())[0].expert_misses_on_gpu
    assert crashes.forget("other:latest") == [] and crashes.forget("other") == ["other"]
    assert crashes.safer("other", RISKY, ()) == (RISKY, ())


def test_amx_hazard_needs_an_amx_cpu_and_an_engine_built_with_amx():
    assert amx_hazard(frozenset({"avx2", "avx512f"}), "never asked") == ""
    assert amx_hazard(frozenset({"amx_tile", "amx_int8"}), "AVX2 AVX512, no AMX") == ""
    why = amx_hazard(frozenset({"amx_tile", "amx_int8"}), "AVX2 AVX512 AMX_INT8, with AMX")
    assert "built with AMX" in why and "scripts/install.sh" in why


@pytest.fixture
def two_models(tmp_path, smollm2_gguf, gemma_gguf, request):
    env = isolated_env(tmp_path / "home", **request.param)
    import_models(env, {"smollm2": smollm2_gguf, "gemma3-270m": gemma_gguf})
    d = start_daemon(env)
    yield d
    d.stop()


@pytest.mark.slow
@pytest.mark.parametrize("two_models", [{"LOCALLLM_TEST_ENGINE_CRASH": "extra_bufts"}],
                         indirect=True)
def test_extra_buffer_types_off_for_the_model_that_crashed_until_forgotten(two_models):
    d = two_models
    assert _generate(d)[0] == 200  # smollm2: crashed with them, loaded without
    assert _daemon_log(d).count(RETRY) == 1
    [model] = d.ps()
    assert model["extra_bufts"] is False and "extra buffer types" in model["crash_note"]
    assert "--forget-crashes smollm2:latest" in d.cli("ps").stderr  # ps notes
    # gemma is not smollm2: its load tries them (and crashes with them, here, on its own)
    assert _generate(d, "gemma3-270m")[0] == 200
    assert _daemon_log(d).count(RETRY) == 2
    # dropped: smollm2's next load has them on again (and the hook crashes it again)
    forgot = d.cli("ps", "--forget-crashes", "smollm2")
    assert forgot.returncode == 0 and "smollm2:latest" in forgot.stdout, forgot
    d.cli("stop", "smollm2")
    assert _generate(d)[0] == 200
    assert _daemon_log(d).count(RETRY) == 3


@pytest.mark.slow
@pytest.mark.errors_expected
@pytest.mark.parametrize("two_models", [{"LOCALLLM_TEST_ENGINE_CRASH": "always"}],
                         indirect=True)
def test_a_model_that_crashes_without_them_too_keeps_no_note(two_models):
    d = two_models
    assert _generate(d)[0] >= 500
    assert "extra buffer types off too; they were not the cause" in _daemon_log(d)
    assert _generate(d)[0] >= 500  # tried with them again: the note was dropped
    assert _daemon_log(d).count(RETRY) == 2


@pytest.mark.slow
@pytest.mark.parametrize("two_models", [{"LOCALLLM_TEST_ENGINE_CRASH": "extra_bufts",
                                         "LOCALLLM_TEST_AMX": "amx_tile amx_int8|AVX2 AVX512 "
                                                              "AMX_INT8, with AMX"}],
                         indirect=True)
def test_an_amx_engine_on_an_amx_cpu_starts_without_extra_buffer_types(two_models):
    """The hook crashes any runner with them on, as ggml's AMX kernels did: none crashes."""
    d = two_models
    assert _generate(d)[0] == 200
    log = _daemon_log(d)
    assert "crashed (SIGSEGV)" not in log and RETRY not in log
    [model] = d.ps()
    assert model["extra_bufts"] is False
    assert any("built with AMX" in r for r in model["plan_reasons"])
    assert "engine: extra buffer types (repack, AMX) off: the engine was built with AMX" \
        in d.cli("ps").stderr


@pytest.mark.slow
def test_a_runner_killed_from_outside_is_not_counted(fresh_daemon):
    def seen(kills: int) -> bool:
        return _daemon_log(fresh_daemon).count("killed from outside") >= kills

    for kills in (1, 2):
        assert _generate(fresh_daemon)[0] == 200
        os.kill(fresh_daemon.ps()[0]["runner_pid"], signal.SIGKILL)
        wait_for(lambda k=kills: seen(k), 60, what="the daemon seeing the kill")
    assert "not counted as a crash" in _daemon_log(fresh_daemon)
    assert _generate(fresh_daemon)[0] == 200
    assert "crash_note" not in fresh_daemon.ps()[0]
