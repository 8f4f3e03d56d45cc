"""The helper models agents ask for that exist only at their vendor: `model_aliases` (a name or
a glob -> a stored model) answered by every route and shown by `list` and `ps`; `launch`
giving each agent's helper names a local model and saying so; and a model's sampling floor
(`min_temperature`) under the temperature 0 Copilot CLI forces. Real daemon, real llama.cpp,
the real `openai`, `anthropic` and `ollama` clients, `localllm` run as a command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from chat_models import tool_model
from daemon_process import isolated_env, start_daemon
from gguf_edit import with_metadata
from test_launch import COPILOT, launch, stand_in

ALIASES = '[model_aliases]\n"gpt-5.4-nano" = "smollm2"\n"claude-haiku-*" = "smollm2"\n' \
          '"gone-*" = "not-stored"\n'
TOOLS = "smollm2-tools:latest"


def _daemon(root: Path, smollm2_gguf: Path, config: str = ""):
    """A daemon with SmolLM2 and a tool-calling copy whose header says 32K (every agent's
    first request fits, as in test_launch.py), and `config` as its config.toml."""
    from conftest import import_models

    env = isolated_env(root)
    if config:
        path = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "config.toml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(config)
    tools = tool_model(smollm2_gguf, root)
    long = with_metadata(tools, root / "tools-32k.gguf", {"llama.context_length": 32768})
    import_models(env, {"smollm2": smollm2_gguf, "smollm2-tools": long})
    return start_daemon(env)


@pytest.fixture(scope="module")
def helper_daemon(tmp_path_factory, smollm2_gguf):
    d = _daemon(tmp_path_factory.mktemp("helpers"), smollm2_gguf, ALIASES)
    yield d
    d.stop()


# ---- the setting ---------------------------------------------------------------------------
def test_model_aliases_is_a_table_in_the_file_and_pairs_in_the_variable(tmp_path):
    from localllm.config import ConfigError, load_config

    path = tmp_path / "config.toml"
    path.write_text(ALIASES)
    assert load_config(path, environ={}).model_aliases == {
        "gpt-5.4-nano": "smollm2", "claude-haiku-*": "smollm2", "gone-*": "not-stored"}
    env = {"LOCALLLM_MODEL_ALIASES": "gpt-5.4-nano=qwen3, claude-*=smollm2"}
    assert load_config(tmp_path / "none.toml", environ=env).model_aliases == {
        "gpt-5.4-nano": "qwen3", "claude-*": "smollm2"}
    path.write_text('model_aliases = "gpt-5.4-nano"\n')
    with pytest.raises(ConfigError, match=r"config.toml:1: model_aliases must be name=model"):
        load_config(path, environ={})


def test_config_set_writes_the_table_and_show_reads_it_back(tmp_path):
    env = isolated_env(tmp_path)
    run = [sys.executable, "-m", "localllm.cli", "config"]
    r = subprocess.run([*run, "set", "model_aliases", "gpt-5.4-nano=smollm2"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*run, "set", "model_aliases", "nothing-here"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    from localllm.config import load_config

    path = Path(env["XDG_CONFIG_HOME"]) / "localllm" / "config.toml"
    assert load_config(path, environ={}).model_aliases == {"gpt-5.4-nano": "smollm2"}


# ---- every route ---------------------------------------------------------------------------
def test_an_alias_answers_on_every_api(helper_daemon):
    ai = openai.OpenAI(base_url=helper_daemon.url + "/v1", api_key="unused", max_retries=0)
    r = ai.chat.completions.create(model="gpt-5.4-nano", max_tokens=4, temperature=0,
                                   messages=[{"role": "user", "content": "Say hi."}])
    assert r.choices[0].message.content
    claude = anthropic.Anthropic(base_url=helper_daemon.url, api_key="unused", max_retries=0)
    m = claude.messages.create(model="claude-haiku-4-5-20251001", max_tokens=4,
                               messages=[{"role": "user", "content": "Say hi."}])
    assert m.content[0].text
    oc = ollama.Client(host=helper_daemon.url)
    assert oc.show("gpt-5.4-nano").modelinfo["general.architecture"] == "llama"
    assert ai.models.retrieve("claude-haiku-3").id
    # Still the 404 for a name no alias covers, and one whose model is not stored says so.
    with pytest.raises(openai.NotFoundError) as e:
        ai.chat.completions.create(model="gpt-5.4-mini", max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:
        ai.chat.completions.create(model="gone-1", max_tokens=4,
                                   messages=[{"role": "user", "content": "hi"}])
    assert "alias (model_aliases) of 'not-stored'" in e.value.body["message"]


def test_list_and_ps_show_the_aliases(helper_daemon):
    assert helper_daemon.get("/api/tags")["aliases"]["gpt-5.4-nano"] == "smollm2"
    # list's after its table; ps's with its notes on stderr (its stdout is a line a model)
    for command, stream in (("list", "stdout"), ("ps", "stderr")):
        r = helper_daemon.cli(command)
        assert r.returncode == 0, r.stderr
        assert "alias gpt-5.4-nano -> smollm2" in getattr(r, stream).splitlines()
        assert "alias claude-haiku-* -> smollm2" in getattr(r, stream).splitlines()


# ---- the sampling floor ----------------------------------------------------------------------
def _answers(daemon, model: str) -> set[str]:
    """What the model answers at temperature 0 under four seeds."""
    out = set()
    for seed in range(4):
        r = httpx.post(daemon.url + "/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 24, "temperature": 0, "seed": seed,
            "messages": [{"role": "user", "content": "Write a short poem about rivers."}]})
        assert r.status_code == 200, r.text
        out.add(r.json()["choices"][0]["message"]["content"])
    return out


def test_a_sampling_floor_lifts_a_forced_temperature_0(helper_daemon):
    r = httpx.post(helper_daemon.url + "/api/create", timeout=120, json={
        "model": "floored", "from": "smollm2", "parameters": {"min_temperature": 1.5},
        "stream": False})
    assert r.status_code == 200, r.text
    shown = httpx.post(helper_daemon.url + "/api/show", json={"model": "floored"}).json()
    assert "min_temperature" in shown["parameters"]
    assert len(_answers(helper_daemon, "smollm2")) == 1  # 0 is greedy: one answer
    assert len(_answers(helper_daemon, "floored")) > 1  # sampled at 1.5: the seeds differ


def test_a_modelfile_parameter_sets_the_floor_and_a_bad_one_is_one_line(helper_daemon,
                                                                        tmp_path):
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text("FROM smollm2\nPARAMETER min_temperature 0.7\n")
    r = helper_daemon.cli("create", "floor-mf", "-f", str(modelfile))
    assert r.returncode == 0, r.stderr
    assert "0.7" in helper_daemon.cli("show", "floor-mf", "--parameters").stdout
    modelfile.write_text("FROM smollm2\nPARAMETER min_temperature -1\n")
    r = helper_daemon.cli("create", "floor-bad", "-f", str(modelfile))
    assert r.returncode != 0
    assert "min_temperature must be between 0 and 100" in r.stderr


# ---- launch ---------------------------------------------------------------------------------
COPILOT_HELPER = COPILOT + """
model = "gpt-5.4-nano"  # what Copilot CLI asks for besides its model, whatever it is told
"""


def test_launch_copilot_makes_its_nano_model_an_alias_and_says_so(tmp_path, smollm2_gguf):
    d = _daemon(tmp_path / "daemon", smollm2_gguf)
    try:
        r = launch(d, tmp_path, "copilot", "--print-env")
        assert r.returncode == 0, r.stderr
        assert "gpt-5.4-nano -> smollm2-tools:latest (would be added" in r.stderr
        config = Path(d.env["XDG_CONFIG_HOME"]) / "localllm" / "config.toml"
        assert not config.exists()  # --print-env writes nothing
        # A stand-in that asks for the nano model, as Copilot CLI does beside its own.
        helper_bin = tmp_path / "helper-bin"
        helper_bin.mkdir()
        stand_in(helper_bin, "copilot", COPILOT_HELPER)
        r = launch(d, tmp_path, "copilot", path=f"{helper_bin}{os.pathsep}{os.environ['PATH']}")
        assert r.returncode == 0, r.stdout + r.stderr
        record = json.loads((tmp_path / "record.json").read_text())
        assert record["status"] == 200, record["answer"]
        assert record["env"]["COPILOT_MODEL"] == TOOLS
        assert "helper model: Copilot CLI's gpt-5.4-nano answers with smollm2-tools:latest " \
               "(the main model)" in r.stderr
        assert "gpt-5.4-nano" in config.read_text()
        assert d.get("/api/tags")["aliases"] == {"gpt-5.4-nano": TOOLS}
        # Launched again: the alias is there, and said to be.
        r = launch(d, tmp_path, "copilot", "--print-env")
        assert "(model_aliases already has it)" in r.stderr
    finally:
        d.stop()


def test_launch_claude_gives_its_small_fast_model_the_helper_named(helper_daemon, tmp_path):
    r = launch(helper_daemon, tmp_path, "claude", "--helper-model", "smollm2", "--print-env")
    assert r.returncode == 0, r.stderr
    env = dict(line.removeprefix("export ").split("=", 1) for line in r.stdout.splitlines()
               if line.startswith("export "))
    assert env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "smollm2"
    assert env["ANTHROPIC_MODEL"] == TOOLS
    assert "Claude Code's small fast model answers with smollm2 (--helper-model)" in r.stderr
    r = launch(helper_daemon, tmp_path, "claude", "--helper-model", "nope", "--print-env")
    assert r.returncode != 0 and "helper model 'nope' is not stored" in r.stderr
