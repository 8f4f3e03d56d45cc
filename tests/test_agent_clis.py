"""The real agent CLIs (Claude Code, Codex, Copilot CLI, opencode), installed from npm at pinned
versions, run one-shot through `localllm launch` against a real daemon: each exits 0 and prints
an answer, and for Claude Code and Codex a tool call reaches the daemon and its result comes
back in the next request (a recording proxy between CLI and daemon sees it). The model is
SmolLM2 with a template that makes it call the agent's shell tool once (tests/chat_models.py
AGENT_TEMPLATE), created with /api/create; greedy sampling. Requests recorded from the real
CLIs (tests/fixtures/agents/, and localllm/cli/agent_requests/: the first request of each, which
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
from chat_models import AGENT_TEMPLATE, COMPACT_TEMPLATE, QWEN_TOOL_TEMPLATE, \
    TOOL_SEARCH_TEMPLATE, WEATHER_TOOL
from daemon_process import isolated_env, start_daemon
from gguf_edit import with_metadata
from mcp_tools_server import WEATHER_MARK
from mcp_tools_server import tools as mcp_tools

ROOT = Path(__file__).resolve().parent.parent
CLIS = ROOT / ".cache" / "agent-clis"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "agents"
# what `launch` sizes each agent's context by
FIRST_REQUESTS = ROOT / "localllm" / "cli" / "agent_requests"
RECORDED = {p.name: p for d in (FIXTURES, FIRST_REQUESTS) for p in d.glob("*.json")}
PINNED = {"@anthropic-ai/claude-code": "2.1.332", "@openai/codex": "0.169.0",
          "@github/copilot": "1.0.102", "opencode-ai": "1.18.33"}
MODEL = "agent"
LONG_MODEL, LONG_CTX = "agent-32k", 32768
SEARCH_MODEL = "search-agent"  # calls Claude Code's ToolSearch, then the MCP tool it found
COMPACT_MODEL = "compact-agent"  # renders the conversation; summarises when asked
RENDER_MODEL = "tools-render"  # renders every tool it is given, as Qwen's template does
MARK = "localllm-tool-ok"  # what the tool the model calls prints
MCP_SERVER = Path(__file__).resolve().parent / "mcp_tools_server.py"


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
    for name, base, template in ((MODEL, "smollm2", AGENT_TEMPLATE),
                                 (LONG_MODEL, "smollm2-32k", AGENT_TEMPLATE),
                                 (SEARCH_MODEL, "smollm2-32k", TOOL_SEARCH_TEMPLATE),
                                 (COMPACT_MODEL, "smollm2-32k", COMPACT_TEMPLATE),
                                 (RENDER_MODEL, "smollm2-32k", QWEN_TOOL_TEMPLATE)):
        reply = httpx.post(f"{d.url}/api/create", timeout=120, json={
            "model": name, "from": base, "template": template,
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
    (localllm/cli/agent_requests/); a CLI pinned anew has its first request recorded again there."""
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


def counted(daemon, body: dict) -> int:
    """A /v1/messages body's input tokens, counted with a template that renders every tool."""
    reply = httpx.post(daemon.url + "/v1/messages/count_tokens", timeout=300,
                       json={**body, "model": RENDER_MODEL, "stream": False})
    assert reply.status_code == 200, reply.text
    return reply.json()["input_tokens"]


def test_claude_code_searches_its_deferred_mcp_tools_through_the_daemon(cli_daemon, agent_bin,
                                                                        tmp_path):
    """An MCP server with 101 tools (tests/mcp_tools_server.py) and tool search on (launch
    sets ENABLE_TOOL_SEARCH): Claude Code sends none of them at first, only its ToolSearch
    tool; the model searches, Claude Code answers with a tool_reference, the daemon renders
    the referenced tool (sent deferred from then on), the model calls it and its result comes
    back. Its first request is at most a tenth of the tokens of the same request with every
    MCP tool in it, as it is sent with tool search off."""
    config = tmp_path / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {"work": {
        "type": "stdio", "command": sys.executable, "args": [str(MCP_SERVER), "100"]}}}))
    agent_args = ["-p", "What is the weather in Paris?", "--mcp-config", str(config),
                  "--strict-mcp-config", "--tools", "Bash,ToolSearch", "--allowedTools",
                  WEATHER_TOOL, "--max-turns", "4"]
    with RecordingProxy(cli_daemon.url) as proxy:
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, "claude", "--model",
                       SEARCH_MODEL, "--", *agent_args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Done: the tool ran." in r.stdout
    from localllm.cli.launch_context import first_request

    first, *later = proxy.bodies("/v1/messages")
    # What launch counted is what Claude Code sent: the tools --tools leaves it.
    assert set(tool_names(first)) == set(tool_names(first_request("claude", agent_args)[1]))
    assert not any(name.startswith("mcp__") for name in tool_names(first))
    mcp_sent = [t for body in later for t in body["tools"] if t["name"].startswith("mcp__")]
    assert mcp_sent and all(t.get("defer_loading") for t in mcp_sent)
    blocks = [block for body in later for m in body["messages"] if m["role"] == "user"
              and isinstance(m["content"], list) for block in m["content"]
              if block.get("type") == "tool_result"]
    references = [ref for block in blocks if isinstance(block["content"], list)
                  for ref in block["content"] if ref.get("type") == "tool_reference"]
    assert {"type": "tool_reference", "tool_name": WEATHER_TOOL} in references
    assert WEATHER_MARK in json.dumps(blocks[-1]["content"])  # the MCP tool ran

    # What the MCP tools cost: deferred, their names in a system message; rendered (as Claude
    # Code sends them with tool search off), their definitions instead.
    alone = without_tool_names(first)
    every = [{"name": f"mcp__work__{t['name']}", "description": t["description"],
              "input_schema": t["inputSchema"]} for t in mcp_tools(100)]
    base, deferred = counted(cli_daemon, alone), counted(cli_daemon, first)
    rendered = counted(cli_daemon, {**alone, "tools": [*alone["tools"], *every]})
    assert base < deferred <= base + (rendered - base) / 10, (base, deferred, rendered)
    # Claude Code's own system prompt and its two tools are most of what is left.
    assert deferred <= rendered / 5, (deferred, rendered)


def without_tool_names(body: dict) -> dict:
    """A /v1/messages body without the lines that name the deferred MCP tools."""
    def strip(block):
        if isinstance(block, dict) and isinstance(block.get("text"), str):
            return {**block, "text": "\n".join(line for line in block["text"].splitlines()
                                               if not line.startswith("mcp__"))}
        return block

    return {**body, "messages": [
        {**m, "content": [strip(b) for b in m["content"]] if isinstance(m["content"], list)
         else strip({"text": m["content"]})["text"]} for m in body["messages"]]}


def usage(record: dict) -> dict:
    """The usage the daemon answered a recorded /v1/messages request with (streamed or not)."""
    try:
        return json.loads(record["answer"])["usage"]
    except ValueError:
        pass
    found = {}
    for line in record["answer"].splitlines():
        if line.startswith("data:"):
            event = json.loads(line.removeprefix("data:"))
            found.update((event.get("message") or {}).get("usage") or {})  # message_start
            found.update(event.get("usage") or {})  # message_delta
    return found


def test_claude_code_compacts_on_the_cached_conversation(cli_daemon, agent_bin, tmp_path):
    """`claude -p /compact --continue` compacts the session before it, as Claude Code's own
    /compact does: its summarising turn is the conversation with the instruction after it, so
    the daemon reads at most a tenth of the transcript again (the rest from the cache), and
    Claude Code records the compaction and the model's summary in its session."""
    tools = ["--tools", "Bash", "--allowedTools", "Bash"]
    # A task as long as a real one (the template's four fixed turns after the conversation are
    # read again each turn: on a transcript of a few lines they would be most of it).
    task = "Run the check. " + " ".join(f"Step {i}: read the log, note what failed and why."
                                        for i in range(120))
    with RecordingProxy(cli_daemon.url) as proxy:
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, "claude", "--model",
                       COMPACT_MODEL, "--", "-p", task, *tools, "--max-turns", "3")
        assert r.returncode == 0, r.stdout + r.stderr
        turns = [q for q in proxy.requests if q["path"] == "/v1/messages"]
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, "claude", "--model",
                       COMPACT_MODEL, "--", "-p", "/compact", "--continue", *tools)
    assert r.returncode == 0, r.stdout + r.stderr
    session = [json.loads(line) for f in (tmp_path / "home" / ".claude").rglob("*.jsonl")
               for line in f.read_text().splitlines()]
    assert any(e.get("subtype") == "compact_boundary" for e in session)
    assert "localllm-tool-ok" in json.dumps([e for e in session if e.get("isCompactSummary")])

    compacting = [q for q in proxy.requests if q["path"] == "/v1/messages"][len(turns)]
    assert "<summary>" in json.dumps(compacting["body"]["messages"][-1])
    last = usage(turns[-1])  # the transcript, as the last turn read it
    transcript = last["input_tokens"] + last["cache_read_input_tokens"]
    read = usage(compacting)
    assert read["output_tokens"] > 0
    assert transcript - read["cache_read_input_tokens"] <= transcript / 10, (last, read)


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


def test_codex_compacts_on_the_cached_conversation(cli_daemon, agent_bin, tmp_path):
    """Codex compacts by itself once a turn's tokens pass model_auto_compact_token_limit (launch
    sets it from the context loaded; here a low one, after `--`, as a user may pass it). With a
    provider other than OpenAI's it does so locally: the conversation so far and its
    checkpoint prompt, sent as an ordinary /v1/responses turn, so the daemon reads the
    conversation from its cache, and at most a tenth of it again; the summary then opens the
    rest of the task."""
    task = "Run the check. " + " ".join(f"Step {i}: read the log, note what failed and why."
                                        for i in range(120))
    with RecordingProxy(cli_daemon.url) as proxy:
        r = run_launch(cli_daemon, agent_bin, tmp_path, proxy.url, "codex", "--model",
                       COMPACT_MODEL, "--", "exec", "-c", "model_auto_compact_token_limit=1500",
                       "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", task)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "context compacted" in r.stdout + r.stderr
    turns = [q for q in proxy.requests if q["path"] == "/v1/responses"]
    [compacting] = [q for q in turns if "CONTEXT CHECKPOINT COMPACTION" in json.dumps(
        q["body"]["input"][-1])]
    before = turns[turns.index(compacting) - 1]  # the conversation, as the turn before read it
    assert MARK in json.dumps(compacting["body"]["input"])  # the tool's output is in it
    transcript = responses_usage(before)["input_tokens"]
    read = responses_usage(compacting)
    cached = read["input_tokens_details"]["cached_tokens"]
    assert read["output_tokens"] > 0
    assert transcript - cached <= transcript / 10, (transcript, read)
    after = turns[turns.index(compacting) + 1:]  # the task goes on from the summary
    assert after and "localllm-tool-ok" in json.dumps(after[0]["body"]["input"])


def responses_usage(record: dict) -> dict:
    """The usage the daemon answered a recorded /v1/responses request with (streamed or not)."""
    try:
        return json.loads(record["answer"])["usage"]
    except ValueError:
        pass
    for line in record["answer"].splitlines():
        if line.startswith("data:"):
            event = json.loads(line.removeprefix("data:"))
            if event.get("type") == "response.completed":
                return event["response"]["usage"]
    raise AssertionError(f"no usage in the answer: {record['answer'][-300:]}")
