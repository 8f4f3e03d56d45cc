"""The real agent CLIs (Claude Code, Codex, Copilot CLI, opencode), installed from npm at pinned
versions, run one-shot through `localllm launch` against a real daemon: each exits 0 and prints
an answer, and for Claude Code and Codex a tool call reaches the daemon and its result comes
back in the next request (a recording proxy between CLI and daemon sees it). The model is
SmolLM2 with a template that makes it call the agent's shell tool once (tests/chat_models.py
AGENT_TEMPLATE), created with /api/create; greedy sampling. Requests recorded from the real
CLIs (tests/fixtures/agents/, and cli/agent_requests/: the first request of each, which
`launch` sizes the context by) are replayed through their routes, which answer 200.

The CLIs are installed once into .cache/agent-clis (reused between runs); without npm, or
without the registry, these tests are skipped saying so. Telemetry and updates are off (the
launch settings); each CLI gets a home of its own.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agent_proxy import RecordingProxy
from chat_models import AGENT_TEMPLATE
from daemon_process import isolated_env, start_daemon
from gguf_edit import with_metadata

ROOT = Path(__file__).resolve().parent.parent
CLIS = ROOT / ".cache" / "agent-clis"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
FIRST_REQUESTS = ROOT / "cli" / "agent_requests"  # what `launch` sizes each agent's context by
RECORDED = {p.name: p for d in (FIXTURES, FIRST_REQUESTS) for p in d.glob("*.json")}
PINNED = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.169.0",
          "@github/copilot": "1.0.102", "opencode-ai": "1.18.33"}
MODEL = "agent"
LONG_MODEL, LONG_CTX = "agent-32k", 32768
MARK = "localllm-tool-ok"  # what the tool the model calls prints


def installed() -> bool:
    for package, version in PINNED.items():
        manifest = CLIS / "node_modules" / package / "package.json"
        if not manifest.exists() or json.loads(manifest.read_text())["version"] != version:
            return False
    return True


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    if not installed():
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed (scripts/install.sh --test installs nodejs and "
                        "npm): the agent CLIs cannot be installed")
        CLIS.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--prefix", str(CLIS),
             *(f"{p}@{v}" for p, v in PINNED.items())],
            capture_output=True, text=True, timeout=900)
        if done.returncode != 0 or not installed():
            pytest.skip(f"npm could not install the agent CLIs (is the registry reachable?): "
                        f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return CLIS / "node_modules" / ".bin"


@pytest.fixture(scope="session")
def cli_daemon(tmp_path_factory, smollm2_gguf):
    """SmolLM2 with the agent template, twice: as trained (8K), and with a header that says
    32K, for the CLIs that refuse a context smaller than their own prompt (Copilot CLI needs
    about 16K; the template keeps the real prompt short)."""
    from conftest import import_models

    root = tmp_path_factory.mktemp("agent-clis")
    env = isolated_env(root)
    long = with_metadata(smollm2_gguf, root / "smollm2-32k.gguf",
                         {"llama.context_length": LONG_CTX})
    import_models(env, {"smollm2": smollm2_gguf, "smollm2-32k": long})
    d = start_daemon(env)
    for name, base in ((MODEL, "smollm2"), (LONG_MODEL, "smollm2-32k")):
        reply = httpx.post(f"{d.url}/api/create", timeout=120, json={
            "model": name, "from": base, "template": AGENT_TEMPLATE,
            "parameters": {"temperature": 0}, "stream": False})
        assert reply.status_code == 200, reply.text
    yield d
    d.stop()


def run_launch(daemon, agent_bin: Path, tmp_path: Path, proxy_url: str, *args: str):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {**daemon.env, "HOME": str(home), "CODEX_HOME": str(home / ".codex"),
           "LOCALLLM_HOST": proxy_url.removeprefix("http://"),
           "PATH": f"{agent_bin}{os.pathsep}{os.environ['PATH']}"}
    (home / ".codex").mkdir(exist_ok=True)
    return subprocess.run([sys.executable, "-m", "localllm.cli", "launch", *args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)


def tool_names(body: dict) -> list:
    return [t.get("name") or (t.get("function") or {}).get("name") for t in body.get("tools")
            or ()]


def assert_sends_the_recorded_first_request(agent: str, bodies: list[dict]) -> None:
    """The pinned CLI still sends the tools of the first request `launch` sizes its context by
    (cli/agent_requests/); a CLI pinned anew has its first request recorded again there."""
    from localllm.cli.launch_context import first_request

    recorded = tool_names(first_request(agent)[1])
    assert any(tool_names(body) == recorded for body in bodies), \
        f"{agent} no longer sends the tools of cli/agent_requests/: record its first request again"


def test_claude_code_calls_a_tool_through_the_daemon(cli_daemon, agent_bin, tmp_path):
    with RecordingProxy(cli_daemon.url) as proxy:
        # All its tools, as `launch claude` sizes the context for (about 12K tokens of them,
        # more than Claude Code takes on the 8K model: the 32K copy)
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, "claude", "--model",
                       LONG_MODEL, "--", "-p", "Run the check.", "--allowedTools", "Bash",
                       "--max-turns", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip()  # the answer, printed
    bodies = proxy.bodies("/v1/messages")
    assert_sends_the_recorded_first_request("claude", bodies)
    results = [block for body in bodies for m in body["messages"] if m["role"] == "user"
               and isinstance(m["content"], list) for block in m["content"]
               if block.get("type") == "tool_result"]
    assert results and MARK in json.dumps(results[-1]["content"])


def test_codex_calls_a_tool_through_the_daemon(cli_daemon, agent_bin, tmp_path):
    with RecordingProxy(cli_daemon.url) as proxy:
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, "codex", "--model", MODEL,
                       "--", "exec", "--skip-git-repo-check",
                       "--dangerously-bypass-approvals-and-sandbox", "Run the check.")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip()
    assert_sends_the_recorded_first_request("codex", proxy.bodies("/v1/responses"))
    outputs = [item for body in proxy.bodies("/v1/responses") for item in body["input"]
               if item.get("type") == "function_call_output"]
    assert outputs and MARK in json.dumps(outputs[-1]["output"])


@pytest.mark.parametrize("agent,args,route", [
    ("copilot", ["-p", "Run the check."], "/v1/chat/completions"),
    ("opencode", ["run", "Run the check."], "/v1/chat/completions"),
])
def test_copilot_and_opencode_answer_through_the_daemon(cli_daemon, agent_bin, tmp_path,
                                                        agent, args, route):
    with RecordingProxy(cli_daemon.url) as proxy:
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, agent, "--model",
                       LONG_MODEL, "--ctx", str(LONG_CTX), "--", *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Done: the tool ran." in r.stdout  # the model's answer, printed by the CLI
    bodies = proxy.bodies(route)
    assert bodies and all(b["model"] == f"{LONG_MODEL}:latest" for b in bodies)
    assert_sends_the_recorded_first_request(agent, bodies)


@pytest.mark.parametrize("fixture", sorted(RECORDED))
def test_recorded_agent_requests_replay_with_200(cli_daemon, fixture):
    """Each request a real CLI sent (recorded through the proxy above), to its route again,
    the model swapped for the test model and the answer kept short."""
    recorded = json.loads(RECORDED[fixture].read_text())
    body = {**recorded["body"], "model": MODEL, "stream": False}
    for limit in ("max_tokens", "max_output_tokens"):
        if limit in body:
            body[limit] = 40
    reply = httpx.post(cli_daemon.url + recorded["path"], json=body, timeout=600,
                       headers=recorded.get("headers", {}))
    assert reply.status_code == 200, reply.text
