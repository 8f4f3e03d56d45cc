"""One load decision: the speculative modes' table, the draft rules the Plan owns, the frozen
Load the planner decides in one call, and a runner that is never sent "auto"."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
from scripts import synth_vision
from localllm.daemon.drafting import DraftChoice
from localllm.daemon.planner import Planner
from localllm.engine.local import RunnerProcess
from localllm.daemon.scheduler import SERVED_REMEMBERED, LoadedRunner
from localllm.engine.params import context_params
from localllm.engine.runner.engine import drafting_modes
from localllm.engine.runner.load import Load
from localllm.engine.runner.protocol import OP_BY_NAME, OPS, Done, GenerationRequest, Loaded
from localllm.modelstore.shape import read_shape
from localllm.planner.plan import Plan, cpu_plan
from localllm.profiles.choose import settings_of

from localllm.config import Config
from localllm.options import LoadOptions, SamplingOptions
from localllm.speculative import (
    AUTO,
    MODES,
    SPECULATIVE_CHOICES,
    SPECULATIVE_MODES,
    UnknownMode,
)


@pytest.mark.parametrize("mode, draft_n_max, ceiling", [
    ("off", 0, 0), ("off", 5, 0), ("lookup", 0, 8), ("mtp", 0, 3), ("draft", 0, 8),
    ("mtp", 5, 5), ("draft", 4, 4), ("lookup", 20, 8),
])
def test_the_draft_rules_are_the_plans_and_llama_and_the_tuner_read_the_same(
        mode, draft_n_max, ceiling):
    plan = Plan(n_ctx=512, speculative=mode, draft_n_max=draft_n_max)
    assert plan.draft_ceiling() == ceiling
    snapshots = ceiling + 1 if ceiling else 0
    assert plan.rollback_positions() == snapshots
    # llama.cpp's context keeps the snapshots the tuner priced: one rule, two readers
    assert context_params(plan).n_rs_seq == settings_of(plan).n_rs_seq == snapshots


def test_an_unknown_mode_is_refused_naming_the_modes_there_are():
    with pytest.raises(UnknownMode) as e:
        _ = Plan(n_ctx=512, speculative="eagle").draft_mode
    assert "'eagle'" in str(e.value) and all(m in str(e.value) for m in SPECULATIVE_MODES)
    # profiles saved before the rename still read
    assert Plan(n_ctx=512, speculative="prompt-lookup").draft_mode.name == "lookup"


def test_auto_is_the_plans_mode_and_a_named_mode_is_itself():
    for row in MODES:
        plan = Plan(n_ctx=512, speculative=row.name)
        assert plan.request_mode(AUTO) == row.name
        assert plan.request_mode("off") == "off"


def test_a_runner_decides_at_load_what_each_speculative_choice_means(tmp_path):
    for row in MODES:
        plan = Plan(n_ctx=512, speculative=row.name)
        runner = RunnerProcess("m", tmp_path / "m.gguf", plan, tmp_path / "runner.log")
        assert runner.request_modes == {name: plan.request_mode(name)
                                        for name in SPECULATIVE_CHOICES}
        assert runner.request_modes[AUTO] == row.name


def test_the_engine_decides_at_load_what_each_mode_drafts_with():
    attention = types.SimpleNamespace(recurrent=False, n_rollback=0)
    decided = drafting_modes(None, attention, draft_cap=8)
    assert decided["off"] == (None, "") and decided["lookup"] == ("lookup", "")
    assert decided["prompt-lookup"] == ("lookup", "")  # an older name reads the same
    assert decided["mtp"][0] is None and "loaded without" in decided["mtp"][1]
    mtp = types.SimpleNamespace(kind="mtp")
    assert drafting_modes(mtp, attention, 3)["mtp"] == ("mtp", "")
    assert "loaded without" in drafting_modes(mtp, attention, 3)["draft"][1]
    # a recurrent state takes drafts back only as far as llama.cpp keeps snapshots of it
    recurrent = types.SimpleNamespace(recurrent=True, n_rollback=0)
    assert drafting_modes(None, recurrent, 8)["lookup"] == (None, "")
    assert drafting_modes(None, types.SimpleNamespace(recurrent=True, n_rollback=9),
                          8)["lookup"] == ("lookup", "")


def fields_of(load: Load):
    for field in dataclasses.fields(load):
        yield getattr(load, field.name)


def test_one_planning_call_decides_a_frozen_load_with_no_auto_left(home, store, smollm2_gguf):
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    shape = read_shape(entry.model_path)
    config = Config(context_policy="fixed", default_ctx=2048, prompt_cache_ram=64)
    load = Planner().decide(config, entry, shape, LoadOptions(), DraftChoice(),
                            prompt_chars=100)
    assert load.plan.n_ctx == 2048  # the Config handed over, not config.toml
    assert load.prompt_cache_bytes == 64 * 2**20
    assert load.plan.speculative in SPECULATIVE_MODES and load.draft_path is None
    assert load.start_band == len(load.bands) or load.bands[load.start_band].n_ctx >= 256
    assert AUTO not in [v for v in fields_of(load) if isinstance(v, str)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        load.plan = cpu_plan(1024)  # type: ignore[misc]
    assert load.serves(load.plan, LoadOptions())
    assert load.serves(load.plan, LoadOptions(num_ctx=2048))
    assert not load.serves(load.plan, LoadOptions(num_ctx=1024))

    # A request asking for a draft model: the plan drafts with it, its file rides along, and
    # only a request asking the same drafter is served by this load.
    asked = LoadOptions(speculative="draft", draft_model="smollm2")
    drafted = Planner().decide(config, entry, shape, asked,
                               DraftChoice("smollm2", entry.model_path), shape)
    assert drafted.plan.speculative == "draft" and drafted.draft_path == entry.model_path
    assert drafted.draft_name == "smollm2" and drafted.bands == ()  # bound to the model
    assert any("from the request's options" in r for r in drafted.plan.reasons)
    assert drafted.serves(drafted.plan, asked)
    assert not drafted.serves(drafted.plan, LoadOptions(speculative="mtp"))
    assert not drafted.serves(drafted.plan, LoadOptions(draft_model="other"))


def test_a_loaded_model_decides_once_per_load_options_whether_it_serves(monkeypatch):
    plan = cpu_plan(2048)
    load = Load(plan, LoadOptions(num_ctx=2048))
    decided: list[LoadOptions] = []
    real = Load.serves
    monkeypatch.setattr(Load, "serves", lambda self, running, asked: (
        decided.append(asked), real(self, running, asked))[1])
    model = LoadedRunner(runner=types.SimpleNamespace(plan=plan, n_parallel=1), entry=None,
                        shape=None, file_id=(), load=load)
    assert decided == [LoadOptions(num_ctx=2048)]  # what it was loaded for, at load
    for _ in range(3):  # warm requests: the answer the load gave the first time
        assert model.serves(LoadOptions(num_ctx=2048)) and model.serves(LoadOptions())
        assert not model.serves(LoadOptions(num_ctx=1024))
    assert decided == [LoadOptions(num_ctx=2048), LoadOptions(), LoadOptions(num_ctx=1024)]
    for n in range(2 * SERVED_REMEMBERED):  # a client asking every num_ctx there is
        model.serves(LoadOptions(num_ctx=512 + n))
    assert len(model.served) <= SERVED_REMEMBERED
    assert not model.serves(LoadOptions(num_ctx=1024))


async def test_the_runner_is_sent_the_plans_mode_never_auto(tmp_path, smollm2_gguf):
    plan = replace_mode(cpu_plan(1024), "lookup")
    runner = RunnerProcess("m", smollm2_gguf, plan, tmp_path / "runner.log")
    modes: list[str] = []
    runner.on_drafts = lambda mode, drafted, accepted: modes.append(mode)
    await runner.start()
    try:
        line = "one two three four five six seven eight nine ten"
        request = GenerationRequest(
            id="a", prompt=f"Repeat this line five times.\n{line}\n{line}\n{line}\n",
            options=SamplingOptions(num_predict=48, temperature=0))
        assert request.options.speculative == AUTO
        events = [e async for e in runner.generate(request)]
    finally:
        await runner.stop()
    done = events[-1]
    # The runner refuses a mode it has no row for, "auto" included: a Done means the daemon
    # side sent the plan's mode, and drafts mean that mode was lookup.
    assert isinstance(done, Done) and done.drafted
    assert modes == ["lookup"]  # acceptance is recorded under the mode that ran


def replace_mode(plan: Plan, mode: str) -> Plan:
    return dataclasses.replace(plan, speculative=mode)


def test_a_load_crosses_the_runner_pipe_as_one_value_and_is_rebuilt_the_same(tmp_path):
    whole = cpu_plan(2048)
    load = Load(whole, LoadOptions(num_ctx=2048, speculative="lookup"),
                (dataclasses.replace(whole, n_ctx=512),), 0, tmp_path / "d.gguf", "d",
                tmp_path / "p.gguf", 1 << 20, tmp_path / "m.gguf", 256)
    wire = json.loads(json.dumps(load.to_wire()))  # as the pipe carries it
    assert OPS[0].name == wire["op"] == "load" and OP_BY_NAME["load"].request is Load
    assert OP_BY_NAME["load"].ends[0] is Loaded
    assert Load.from_wire(wire) == load


class SmallBatches(Planner):
    def choose(self, shape, model_name, n_ctx, load, draft_shape=None, projector=None,
               hint=None):
        return dataclasses.replace(cpu_plan(1024), n_ubatch=64, n_batch=64)


def test_planning_decides_the_images_micro_batch_and_no_bands_beside_a_projector(
        home, store, smollm2_gguf, tmp_path):
    entry = store.import_gguf(smollm2_gguf, "smollm2")
    projector = synth_vision.write_projector(tmp_path / "mmproj.gguf",
                                             synth_vision.PROJECTORS["gemma3-27b"],
                                             fill="sparse")
    config = Config(context_policy="fixed", default_ctx=1024, fill_bands="auto")
    load = SmallBatches().decide(config, entry, read_shape(entry.model_path), LoadOptions(),
                                 DraftChoice(), projector=projector)
    # Gemma 3's projector attends across a whole image: its 256 tokens in one micro-batch
    assert load.image_tokens == 256 and load.bands == ()
    assert load.plan.n_ubatch == 256 and load.plan.n_batch == 256
    assert any("one image's tokens are read in one" in r for r in load.plan.reasons)
    assert load.model_path == entry.model_path and load.projector == projector
