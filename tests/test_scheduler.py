"""The scheduler with real runner processes: step-down after a failed load, context policy."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
from daemon_process import wait_for_async
from localllm.engine.local import LoadError
from localllm.daemon.scheduler import Planner, Scheduler, context_to_ask
from localllm.engine.runner.protocol import Done, GenerationRequest, SamplingOptions
from localllm.modelstore.shape import read_shape
from localllm.planner.plan import cpu_plan

from localllm.config import Config
from localllm.options import LoadOptions


class FirstPlanFails(Planner):
    """A planner whose first plan llama.cpp refuses (a quantized V cache without flash
    attention fails context creation, as an out-of-memory load does), and whose step-down
    gives a plan that loads. Records what the scheduler asked for."""

    def __init__(self, steps: int = 1):
        self.steps = steps
        self.errors: list[str] = []

    def choose(self, shape, model_name, n_ctx, options, draft_shape=None, hint=None):
        return replace(cpu_plan(n_ctx or 1024, shape.context_length), type_k="q4_0",
                       type_v="q4_0", flash_attn=False)

    def step_down(self, plan, shape, model_name, error):
        self.errors.append(error)
        if len(self.errors) >= self.steps + 1:
            return None
        return replace(cpu_plan(plan.n_ctx, shape.context_length), source="step-down",
                       reasons=("stepped down after: " + error,))


async def generate_once(scheduler, entry):
    request = GenerationRequest(id="t", prompt="Hello",
                                options=SamplingOptions(num_predict=3, temperature=0))
    async with scheduler.use(entry, LoadOptions(num_ctx=1024)) as runner:
        events = [e async for e in runner.generate(request)]
    return runner, events


async def test_a_failed_load_steps_down_and_serves(store, smollm2_gguf, tmp_path):
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    planner = FirstPlanFails()
    scheduler = Scheduler(store, Config(), tmp_path / "logs", planner)
    await scheduler.start()
    try:
        runner, events = await generate_once(scheduler, entry)
        assert isinstance(events[-1], Done) and events[-1].eval_count > 0
        assert runner.plan.source == "step-down" and runner.plan.type_v == "f16"
        assert len(planner.errors) == 1 and "smollm2" in planner.errors[0]
    finally:
        await scheduler.close()


async def test_when_no_smaller_plan_is_left_the_load_error_reaches_the_caller(
        store, smollm2_gguf, tmp_path):
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    scheduler = Scheduler(store, Config(), tmp_path / "logs", FirstPlanFails(steps=0))
    await scheduler.start()
    try:
        with pytest.raises(LoadError, match="cannot load|exited"):
            await generate_once(scheduler, entry)
        assert scheduler.models == {}
    finally:
        await scheduler.close()


async def test_a_runner_killed_while_loading_is_not_stepped_down(store, smollm2_gguf,
                                                                 tmp_path):
    """SIGKILL at load is the kernel's OOM killer as a rule: RAM, which a plan with less on the
    GPU would need more of. The error reaches the caller, saying so, with no step-down."""
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    planner = FirstPlanFails()
    killed = (sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    scheduler = Scheduler(store, Config(), tmp_path / "logs", planner, runner_command=killed)
    await scheduler.start()
    try:
        with pytest.raises(LoadError, match="killed by SIGKILL - most likely out of memory"):
            await generate_once(scheduler, entry)
        assert planner.errors == [], "no smaller plan was asked for"
        assert scheduler.models == {}
    finally:
        await scheduler.close()


def test_context_policy_decides_the_context_asked_for(smollm2_gguf):
    shape = read_shape(smollm2_gguf)
    assert context_to_ask(Config(context_policy="fixed", default_ctx=2048), None, shape) == 2048
    assert context_to_ask(Config(context_policy="max"), None, shape) == 8192
    assert context_to_ask(Config(context_policy="fit"), None, shape) is None
    assert context_to_ask(Config(context_policy="fit"), 1024, shape) == 1024


class FourThreads(Planner):
    """CPU plans of 4 decode and 4 prompt threads, whatever this host's cores."""

    def choose(self, shape, model_name, n_ctx, options, draft_shape=None, hint=None):
        return replace(cpu_plan(n_ctx or 512, shape.context_length), n_threads=4,
                       n_threads_batch=4)


async def test_two_models_busy_on_the_cpu_share_its_threads_and_one_alone_takes_all_back(
        store, smollm2_gguf, gemma_gguf, tmp_path):
    smol = store.import_gguf(smollm2_gguf, "smollm2")
    gemma = store.import_gguf(gemma_gguf, "gemma")
    scheduler = Scheduler(store, Config(), tmp_path / "logs", FourThreads())
    await scheduler.start()
    load = LoadOptions(num_ctx=512)
    try:
        async with scheduler.use(smol, load) as first:
            assert first.n_threads == 4 and first.threads_reason == ""  # alone: the plan's
            async with scheduler.use(gemma, load) as second:
                # told before its request: llama.cpp's own count, half the plan's
                assert second.n_threads == 2
                assert "2 models compute on the CPU at once: 2 of the plan's 4 threads, 2 of " \
                       "4 for prompts" in second.threads_reason
                await wait_for_async(lambda: first.n_threads == 2, 60,
                                     what="the busy runner to drop to 2 threads")
                request = GenerationRequest(id="s", prompt="Hello",
                                            options=SamplingOptions(num_predict=3))
                events = [e async for e in second.generate(request)]
                assert isinstance(events[-1], Done) and events[-1].eval_count > 0
            await wait_for_async(lambda: first.n_threads == 4, 60,
                                 what="the runner left alone to take 4 threads back")
            assert "alone on the CPU again: 4 threads, 4 for prompts" in first.threads_reason
            # the idle one gets its plan's threads back too (ps shows what it holds)
            await wait_for_async(lambda: second.n_threads == 4, 60,
                                 what="the idle runner to take 4 threads back")
    finally:
        await scheduler.close()


def test_a_model_whole_on_the_gpu_does_not_take_a_share_of_the_cpu():
    from types import SimpleNamespace

    from localllm.daemon.scheduler import computes_on_cpu
    from localllm.planner.plan import Plan, TensorOverride

    def loaded(plan):
        return SimpleNamespace(runner=SimpleNamespace(running_plan=plan),
                               shape=SimpleNamespace(n_layer=24))

    assert not computes_on_cpu(loaded(Plan(512, n_gpu_layers=25)))
    assert computes_on_cpu(loaded(Plan(512, n_gpu_layers=24)))  # the output layer on the CPU
    assert computes_on_cpu(loaded(Plan(512, n_gpu_layers=0)))
    experts = (TensorOverride(r"ffn_.*_exps", "CPU"),)
    assert computes_on_cpu(loaded(Plan(512, n_gpu_layers=25, tensor_overrides=experts)))
