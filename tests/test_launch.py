"""`localllm launch claude | codex`: the setup it prints, and the agents it runs against a real
daemon. The agents are stand-in scripts on PATH that record their environment and arguments
and make one request to the URL they were given."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from chat_models import tool_model
from daemon_process import isolated_env, start_daemon
from gguf_edit import with_metadata

MODEL = "smollm2-tools:latest"  # SmolLM2 with a header that says 32K: every agent's request fits
SHORT = "tools-8k:latest"  # SmolLM2 as trained, on 8,192 tokens: no agent's first request fits

# Claude Code: ANTHROPIC_BASE_URL, the token and the model from its environment.
CLAUDE = """
base = os.environ["ANTHROPIC_BASE_URL"]
token = os.environ["ANTHROPIC_AUTH_TOKEN"]
model = os.environ["ANTHROPIC_MODEL"]
url = base + "/v1/chat/completions"
"""
# Codex: the provider's base_url and the model from its -c overrides.
CODEX = """
args = sys.argv[1:]
over = dict(args[i + 1].split("=", 1) for i in range(len(args) - 1) if args[i] == "-c")
base = json.loads(over["model_providers.localllm.base_url"])
model = json.loads(over["model"])
token = "none"
url = base + "/chat/completions"
"""
# Copilot CLI: its provider's base URL, key and model from its environment.
COPILOT = """
base = os.environ["COPILOT_PROVIDER_BASE_URL"]
token = os.environ["COPILOT_PROVIDER_API_KEY"]
model = os.environ["COPILOT_MODEL"]
url = base + "/chat/completions"
"""
REQUEST = """
body = json.dumps({"model": model, "max_tokens": 4,
                   "messages": [{"role": "user", "content": "Say hi."}]}).encode()
req = urllib.request.Request(url, data=body, headers={
    "Authorization": "Bearer " + token, "Content-Type": "application/json"})
try:
    with urllib.request.urlopen(req, timeout=120) as resp:
        status, answer = resp.status, json.loads(resp.read())
except urllib.error.HTTPError as e:
    status, answer = e.code, e.read().decode()
with open(os.environ["AGENT_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ), "url": url,
               "status": status, "answer": answer}, f)
sys.exit(0 if status == 200 else 3)
"""


def stand_in(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!{sys.executable}\nimport json, os, sys, urllib.error, urllib.request\n"
                    + textwrap.dedent(body) + REQUEST)
    path.chmod(0o755)


@pytest.fixture(scope="module")
def launch_daemon(tmp_path_factory, smollm2_gguf):
    from conftest import import_models

    root = tmp_path_factory.mktemp("launch")
    env = isolated_env(root)
    # A model that cannot call tools and two that can: launch picks the smallest of those
    # (no GPU), by name where they tie.
    tools = tool_model(smollm2_gguf, root)
    long = with_metadata(tools, root / "tools-32k.gguf", {"llama.context_length": 32768})
    import_models(env, {"smollm2": smollm2_gguf, "smollm2-tools": long, "tools-8k": tools})
    d = start_daemon(env)
    yield d
    d.stop()


def launch(daemon, tmp_path, *args: str, path: str | None = None):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stand_in(bin_dir, "claude", CLAUDE)
    stand_in(bin_dir, "codex", CODEX)
    stand_in(bin_dir, "copilot", COPILOT)
    env = {**daemon.env, "LOCALLLM_HOST": daemon.url.removeprefix("http://"),
           "AGENT_RECORD": str(tmp_path / "record.json"),
           "PATH": path if path is not None else f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([sys.executable, "-m", "localllm.cli", "launch", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def exports(stdout: str) -> dict[str, str]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = shlex.split(value)[0] if value else ""
    return out


def test_print_env_shows_claude_code_pointed_here_with_every_tier_local(launch_daemon,
                                                                        tmp_path):
    r = launch(launch_daemon, tmp_path, "claude", "--print-env")
    assert r.returncode == 0, r.stderr
    env = exports(r.stdout)
    assert env["ANTHROPIC_BASE_URL"] == launch_daemon.url
    assert env["ANTHROPIC_AUTH_TOKEN"]  # no API key set: a placeholder
    for tier in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                 "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                 "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[tier] == MODEL, tier
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert r.stdout.splitlines()[-1] == f"claude --model {MODEL}"
    assert not (tmp_path / "record.json").exists()  # nothing was run
    # Every name it gives the agent exists: the daemon shows it.
    assert launch_daemon.cli("show", MODEL).returncode == 0


def test_print_config_shows_a_responses_provider_as_overrides(launch_daemon, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    r = launch(launch_daemon, tmp_path, "codex", "--print-config")
    assert r.returncode == 0, r.stderr
    argv = shlex.split(r.stdout.splitlines()[-1])
    assert argv[0] == "codex"
    over = dict(a.split("=", 1) for a in argv[2::2])
    assert set(argv[1::2]) == {"-c"}
    assert json.loads(over["model_providers.localllm.base_url"]) == launch_daemon.url + "/v1"
    assert json.loads(over["model_providers.localllm.wire_api"]) == "responses"
    assert json.loads(over["model_provider"]) == "localllm"
    assert json.loads(over["model"]) == MODEL
    assert int(over["model_context_window"]) == 32768  # the header's trained context


def test_launch_runs_each_agent_and_its_request_succeeds(launch_daemon, tmp_path):
    r = launch(launch_daemon, tmp_path, "claude", "--", "-p", "hello there")
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["status"] == 200 and record["answer"]["model"] == MODEL
    assert record["argv"] == ["--model", MODEL, "-p", "hello there"]
    assert record["env"]["ANTHROPIC_BASE_URL"] == launch_daemon.url
    assert record["env"]["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
    # Loaded with the long context it planned (the header's 32,768 < 64K; it said so).
    assert "trained on 32768" in r.stderr
    loaded = {m["model"]: m for m in launch_daemon.ps()}
    assert loaded[MODEL]["context_length"] == 32768

    (tmp_path / "record.json").unlink()
    r = launch(launch_daemon, tmp_path, "codex", "--", "exec", "hi")
    assert r.returncode == 0, r.stdout + r.stderr
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["status"] == 200
    assert record["url"] == launch_daemon.url + "/v1/chat/completions"
    assert record["argv"][-2:] == ["exec", "hi"]


def test_a_missing_agent_gets_one_line_saying_how_to_install_it(launch_daemon, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for agent, package in (("claude", "@anthropic-ai/claude-code"), ("codex", "@openai/codex"),
                           ("copilot", "@github/copilot"), ("opencode", "opencode-ai")):
        r = launch(launch_daemon, tmp_path, agent, path=str(empty))
        assert r.returncode == 1
        assert len(r.stderr.strip().splitlines()) == 1
        assert f"npm i -g {package}" in r.stderr


def test_an_unknown_model_is_one_line_naming_it(launch_daemon, tmp_path):
    r = launch(launch_daemon, tmp_path, "claude", "--model", "no-such-model", "--print-env")
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1 and "no-such-model" in r.stderr


def test_the_pick_is_the_largest_tool_model_that_fits_else_the_smallest():
    from localllm.cli.launch import pick_model

    def m(name, size, tools=True):
        return {"name": name, "size": size, "capabilities": ["tools"] if tools else [],
                "trained_ctx": 0}

    models = [m("big", 40), m("mid", 20), m("small", 5), m("chat", 30, tools=False)]
    assert pick_model(models, free_vram=25)["name"] == "mid"
    assert pick_model(models, free_vram=100)["name"] == "big"
    assert pick_model(models, free_vram=0)["name"] == "small"
    from localllm.errors import UserError

    with pytest.raises(UserError, match="no stored model can call tools"):
        pick_model([m("chat", 30, tools=False)], free_vram=100)


def test_with_no_gpu_the_pick_fits_the_ram_or_says_why_none_does():
    from localllm.cli.launch import pick_model
    from localllm.errors import UserError

    gb = 10**9
    models = [{"name": n, "size": s, "capabilities": ["tools"], "trained_ctx": 0}
              for n, s in (("big", 18_600_000_000), ("mid", 5 * gb))]
    assert pick_model(models, free_vram=0, ram_room=8 * gb)["name"] == "mid"
    assert pick_model(models, free_vram=2 * gb, ram_room=4 * gb)["name"] == "mid"
    with pytest.raises(UserError, match=r"fits this machine \(3.*of RAM and no GPU\).*mid"):
        pick_model(models, free_vram=0, ram_room=3 * gb)


def test_each_agent_is_told_the_context_and_kept_off_the_network(launch_daemon, tmp_path):
    """The loaded context and each agent's own switches (telemetry, analytics, updates) as
    their docs and binaries name them; the model is loaded with the 32,768 tokens its header
    says it was trained on."""
    claude = exports(launch(launch_daemon, tmp_path, "claude", "--print-env").stdout)
    assert claude["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "32768"
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in claude  # it takes 100K at least
    assert claude["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "8192"  # a quarter
    assert claude["DISABLE_TELEMETRY"] == claude["DISABLE_AUTOUPDATER"] == "1"
    assert claude["ENABLE_TOOL_SEARCH"] == "true"  # the daemon runs the tool search

    r = launch(launch_daemon, tmp_path, "codex", "--print-config")
    argv = shlex.split(r.stdout.splitlines()[-1])
    over = dict(a.split("=", 1) for a in argv[2::2])
    assert int(over["model_auto_compact_token_limit"]) == 32768 - 32768 // 4
    assert over["analytics.enabled"] == over["feedback.enabled"] == "false"
    assert over["check_for_update_on_startup"] == "false"

    r = launch(launch_daemon, tmp_path, "copilot", "--print-env")
    assert r.returncode == 0, r.stderr
    copilot = exports(r.stdout)
    assert copilot["COPILOT_PROVIDER_BASE_URL"] == launch_daemon.url + "/v1"
    assert copilot["COPILOT_MODEL"] == MODEL
    assert copilot["COPILOT_PROVIDER_WIRE_API"] == "completions"
    assert int(copilot["COPILOT_PROVIDER_MAX_PROMPT_TOKENS"]) + int(
        copilot["COPILOT_PROVIDER_MAX_OUTPUT_TOKENS"]) == 32768
    assert copilot["COPILOT_OFFLINE"] == "true" and copilot["COPILOT_AUTO_UPDATE"] == "false"
    assert shlex.split(r.stdout.splitlines()[-1]) == ["copilot", "--no-auto-update"]

    r = launch(launch_daemon, tmp_path, "opencode", "--print-env")
    assert r.returncode == 0, r.stderr
    opencode = exports(r.stdout)
    config = json.loads(opencode["OPENCODE_CONFIG_CONTENT"])
    provider = config["provider"]["localllm"]
    assert provider["options"]["baseURL"] == launch_daemon.url + "/v1"
    assert provider["models"][MODEL]["limit"] == {"context": 32768, "output": 8192}
    assert config["model"] == f"localllm/{MODEL}" and config["autoupdate"] is False
    assert opencode["OPENCODE_DISABLE_AUTOUPDATE"] == "1"


def _first_request_tokens(daemon, agent: str, model: str, agent_args=()) -> int:
    """The agent's recorded first request counted by the daemon's own route for its wire
    format, as `launch` counts it."""
    import httpx

    from localllm.cli.launch_context import COUNT_ROUTES, first_request

    path, body = first_request(agent, agent_args)
    body = {k: v for k, v in body.items() if k != "stream_options"}
    reply = httpx.post(daemon.url + COUNT_ROUTES[path], timeout=300,
                       json={**body, "model": model, "stream": False})
    assert reply.status_code == 200, reply.text
    return reply.json()["input_tokens"]


def test_a_context_too_small_for_the_agent_is_loaded_larger(launch_daemon, tmp_path):
    """Asked for 4K (as a default too small would be), launch loads what Codex's real first
    request (its recorded system prompt and tools) and an answer need, says so, and tells Codex
    the context that was loaded."""
    from localllm.cli.launch_context import ANSWER_MIN

    first = _first_request_tokens(launch_daemon, "codex", MODEL)
    assert first > 4096  # Codex's instructions and nine tools, with this model's tokenizer
    r = launch(launch_daemon, tmp_path, "codex", "--ctx", "4096",
               "--print-config")
    assert r.returncode == 0, r.stderr
    assert f"first request is {first} tokens" in r.stderr
    loaded = {m["model"]: m["context_length"] for m in launch_daemon.ps()}[MODEL]
    assert first + ANSWER_MIN <= loaded < 32768
    over = dict(a.split("=", 1) for a in shlex.split(r.stdout.splitlines()[-1])[2::2])
    assert int(over["model_context_window"]) == loaded
    assert first < int(over["model_auto_compact_token_limit"]) <= loaded - ANSWER_MIN


def test_claude_code_told_to_offer_fewer_tools_gets_the_context_those_need(launch_daemon,
                                                                          tmp_path):
    """`-- --tools Bash,Read`: Claude Code sends two of its built-in tools, not twelve, and
    launch counts only those; asked for 4K, it loads a context that holds that smaller first
    request, smaller than the one all its tools need."""
    from localllm.cli.launch_context import ANSWER_MIN

    every = _first_request_tokens(launch_daemon, "claude", MODEL)
    fewer = _first_request_tokens(launch_daemon, "claude", MODEL, ["--tools", "Bash,Read"])
    assert fewer < every / 2  # Agent, Workflow, ScheduleWakeup... are most of its tokens
    told = {}
    for agent_args in ((), ("--tools", "Bash,Read")):
        r = launch(launch_daemon, tmp_path, "claude", "--ctx", "4096", "--print-env", "--",
                   *agent_args)
        assert r.returncode == 0, r.stderr
        told[agent_args] = int(exports(r.stdout)["CLAUDE_CODE_MAX_CONTEXT_TOKENS"])
        assert shlex.split(r.stdout.splitlines()[-1])[3:] == list(agent_args)
    assert f"first request is {fewer} tokens" in r.stderr
    assert {m["model"]: m["context_length"] for m in launch_daemon.ps()}[MODEL] == \
        told[("--tools", "Bash,Read")]
    assert fewer + ANSWER_MIN <= told[("--tools", "Bash,Read")] < every + ANSWER_MIN \
        <= told[()]


def test_the_tools_claude_code_is_told_of_are_the_tools_counted():
    from localllm.cli.launch_context import first_request, tool_name

    def sent(*agent_args):
        return {tool_name(t) for t in first_request("claude", agent_args)[1]["tools"]}

    every = sent()
    assert len(every) == 12 and sent("--tools", "default") == every
    placeholder = {"DeferredToolPlaceholder"}  # deferred: it costs no tokens
    assert sent("--tools", "Bash", "Read", "-p", "hi") == {"Bash", "Read"} | placeholder
    assert sent("--tools=Bash,Read") == sent("--tools", "Bash Read") == sent("-p", "hi",
                                                                            "--tools", "Bash,Read")
    assert sent("--tools", "") == placeholder
    assert sent("--disallowedTools", "Agent", "Workflow") == every - {"Agent", "Workflow"}
    # A rule on a tool's arguments limits what it runs; the tool is still sent.
    assert sent("--disallowed-tools", "Bash(git *)") == every


@pytest.mark.parametrize("agent", ["claude", "codex", "copilot"])
def test_a_model_too_small_for_the_agent_is_refused_saying_why(launch_daemon, tmp_path,
                                                               agent):
    """SmolLM2 was trained on 8,192 tokens: less than these agents' first request and an
    answer. One line says so, and nothing runs."""
    first = _first_request_tokens(launch_daemon, agent, SHORT)
    r = launch(launch_daemon, tmp_path, agent, "--model", SHORT)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"first request is {first} tokens" in lines[0]
    assert "trained on 8192 tokens" in lines[0] and SHORT in lines[0]
    assert not (tmp_path / "record.json").exists()


def test_a_model_without_tools_is_refused_before_the_agent_runs(launch_daemon, tmp_path):
    r = launch(launch_daemon, tmp_path, "claude", "--model", "smollm2")
    assert r.returncode == 1
    assert len(r.stderr.strip().splitlines()) == 1
    assert "cannot run Claude Code" in r.stderr and "does not support tools" in r.stderr
    assert not (tmp_path / "record.json").exists()


def test_a_model_whose_plan_cannot_hold_the_agent_is_refused_saying_why(tmp_path,
                                                                        smollm2_gguf):
    """The model was trained on 32K, but the daemon may give it 300 MB of RAM: its plan holds
    less context than Codex's first request and an answer. One line says what fits and why."""
    import re

    from conftest import import_models
    from localllm.cli.launch_context import ANSWER_MIN

    env = isolated_env(tmp_path / "d", LOCALLLM_RAM_BUDGET="300M")
    long = with_metadata(tool_model(smollm2_gguf, tmp_path), tmp_path / "t32.gguf",
                         {"llama.context_length": 32768})
    import_models(env, {"smollm2-tools": long})
    d = start_daemon(env)
    try:
        first = _first_request_tokens(d, "codex", MODEL)
        r = launch(d, tmp_path, "codex", "--model", MODEL)
    finally:
        d.stop()
    assert r.returncode == 1
    [line] = r.stderr.strip().splitlines()
    assert f"cannot run Codex here: Codex's first request is {first} tokens" in line
    largest = int(re.search(r"the largest context that fits is (\d+) tokens", line).group(1))
    assert largest < first + ANSWER_MIN and "ram_budget" in line
    assert not (tmp_path / "record.json").exists()


@pytest.mark.errors_expected
def test_a_broken_stored_model_does_not_stop_launch_with_another_named(tmp_path, smollm2_gguf):
    """A stored model whose file was cut short answers /api/show with an error: launch with
    --model naming a good one goes on (it stopped at the first such model)."""
    import shutil

    from conftest import import_models

    env = isolated_env(tmp_path / "d")
    broken = tmp_path / "broken.gguf"
    shutil.copyfile(smollm2_gguf, broken)
    broken.chmod(0o600)
    long = with_metadata(tool_model(smollm2_gguf, tmp_path), tmp_path / "t32.gguf",
                         {"llama.context_length": 32768})
    import_models(env, {"aaa-broken": broken, "smollm2-tools": long})
    with open(broken, "r+b") as f:  # the store's blob is a hard link of it
        f.truncate(4096)
    d = start_daemon(env)
    try:
        assert d.cli("show", "aaa-broken").returncode == 1
        r = launch(d, tmp_path, "claude", "--model", MODEL, "--print-env")
    finally:
        d.stop()
    assert r.returncode == 0, r.stderr
    assert exports(r.stdout)["ANTHROPIC_MODEL"] == MODEL
