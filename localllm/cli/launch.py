"""`localllm launch claude | codex | copilot | opencode`: run a coding agent against the local
daemon.

    localllm launch claude                       the best tool-capable model, 64K of context
    localllm launch codex --model qwen3-coder --ctx 32768 -- --full-auto
    localllm launch claude --print-env           the environment it would set, nothing run

It starts the daemon when it is not running, picks the model (`--model`, else the largest
tool-capable stored model whose weights fit this card's free VRAM; the smallest where none
does), loads it with at least 64K of context where that fits (the model's trained length where
that is less; otherwise it says what fits and loads that), and at least the agent's first
request and room for its answer (launch_context.py: counted with this model, so where the
model cannot hold them, it says why and runs nothing); then runs the agent pointed here:

- Claude Code speaks Anthropic's Messages API: `ANTHROPIC_BASE_URL`, a token
  (`ANTHROPIC_AUTH_TOKEN`: the daemon's API key, else a placeholder), every model tier set to
  the local model, and the settings that keep its prompt the same from request to request so
  the prompt cache can reuse it: no attribution line (`CLAUDE_CODE_ATTRIBUTION_HEADER=0`: it
  carries a per-request hash at the very start of the system prompt), no telemetry, error
  reports, surveys or other traffic the local model has no use for.
  It is told the context it has (`CLAUDE_CODE_MAX_CONTEXT_TOKENS`, and from 100K tokens on
  `CLAUDE_CODE_AUTO_COMPACT_WINDOW`, the least it takes) and asks for answers of at most
  a quarter of it (`CLAUDE_CODE_MAX_OUTPUT_TOKENS`; launch_context.answer_room).
- Codex speaks the Responses API: a `localllm` model provider with `wire_api = "responses"`,
  the context window and the point it compacts at, and analytics, feedback and the update
  check off, given as `-c` overrides on its command line; the user's ~/.codex/config.toml is
  never written.
- Copilot CLI in its bring-your-own-key mode (`COPILOT_PROVIDER_*` over chat completions, the
  prompt and answer limits from the context), offline (`COPILOT_OFFLINE`: no GitHub traffic)
  and without auto-update.
- opencode with a `localllm` provider (OpenAI-compatible) and the model's context and output
  limits, given as `OPENCODE_CONFIG_CONTENT`; autoupdate, sharing and the models.dev fetch off.

Each agent's helper model (Claude Code's small fast model, opencode's small_model, Copilot
CLI's gpt-5.4-nano, made an alias here) is the main model or `--helper-model`, and launch says
which (launch_helpers.py).

Every limit an agent is told comes from the context the daemon loaded (`/api/ps`), also with
`--print-env`, which loads the model as launching would and runs nothing. The agent is sent
the model's name as the store lists it, so every request names a model that exists (an agent
that sends another name gets the API's 404, which names it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, replace

from localllm.errors import UserError
from localllm.units import human_size

from .launch_context import Need, answer_room, check_trained, first_request_tokens, \
    too_small_for_card

WANTED_CTX = 65536
CLAUDE_MIN_WINDOW = 100_000  # the least CLAUDE_CODE_AUTO_COMPACT_WINDOW Claude Code takes
PLACEHOLDER_TOKEN = "localllm"  # any non-empty token: the daemon has no API key set
AGENTS = {
    "claude": ("Claude Code", "npm i -g @anthropic-ai/claude-code"),
    "codex": ("Codex", "npm i -g @openai/codex"),
    "copilot": ("Copilot CLI", "npm i -g @github/copilot"),
    "opencode": ("opencode", "npm i -g opencode-ai"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch", help="run Claude Code, Codex, Copilot CLI or opencode against a local model",
        usage="localllm launch {claude,codex,copilot,opencode} [--model M] [--ctx N] "
        "[--helper-model M] [--print-env] "
        "[--print-config] [-- AGENT ARGS]",
        description="Start the daemon if needed, load a tool-capable model with a long "
        "context, and run the coding agent pointed at it. Arguments after `--` go to the "
        "agent.")
    add_options(p)
    # The agent, then our options, then `--` and the agent's own arguments: read by
    # `split_rest` (argparse alone would take the agent's options for ours, and drops a `--`
    # right after a positional).
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="{claude,codex,copilot,opencode}",
                   help="which agent to run")
    p.set_defaults(func=cmd_launch)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", help="a stored model (default: the best tool-capable one "
                   "for this card)")
    p.add_argument("--ctx", type=int, metavar="N",
                   help=f"context length to load the model with (default: {WANTED_CTX}, or "
                   "the model's trained length where that is less)")
    p.add_argument("--helper-model", metavar="M",
                   help="a stored model for the agent's side requests (its small fast "
                   "model; Copilot CLI's gpt-5.4-nano); default: the main model")
    p.add_argument("--print-env", action="store_true",
                   help="load the model as launching would, print the environment and "
                   "command line the agent would get, and run nothing")
    p.add_argument("--print-config", action="store_true", help="the same as --print-env")


def split_rest(args) -> list[str]:
    """The agent (into `args.agent`), our options after it (into `args`), and the agent's
    own arguments (returned)."""
    rest = list(args.rest)
    if not rest or rest[0] not in AGENTS:
        raise UserError(f"launch which agent? {' or '.join(sorted(AGENTS))} "
                        f"(got {rest[0] if rest else 'nothing'})")
    args.agent, rest = rest[0], rest[1:]
    ours, agent_args = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) \
        if "--" in rest else (rest, [])
    own = argparse.ArgumentParser(prog=f"localllm launch {args.agent}", add_help=False)
    add_options(own)
    own.parse_args(ours, namespace=args)
    return agent_args


@dataclass(frozen=True)
class Setup:
    """What the agent is run with."""
    agent: str
    model: str
    n_ctx: int
    env: dict[str, str]  # set on top of the user's environment
    argv: list[str]  # the agent's command line, its executable first


def claude_env(base_url: str, model: str, token: str, n_ctx: int,
               answer: int, helper: str) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": token,
        "ANTHROPIC_API_KEY": "",  # a user's real key must not go to the local server
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": helper,
        "ANTHROPIC_SMALL_FAST_MODEL": helper,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_FEEDBACK_COMMAND": "1",
        "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1",
        "DISABLE_AUTOUPDATER": "1",
        # Claude Code keeps MCP tools out of the prompt only where the server runs a tool
        # search, which it assumes of Anthropic's own URL alone: this daemon runs one.
        "ENABLE_TOOL_SEARCH": "true",
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(n_ctx),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(answer),
        # Claude Code takes a compaction window of 100K at least (it warns and ignores less):
        # a smaller context is enforced by CLAUDE_CODE_MAX_CONTEXT_TOKENS alone.
        **({"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(n_ctx)} if n_ctx >= CLAUDE_MIN_WINDOW
           else {}),
    }


def codex_args(base_url: str, model: str, n_ctx: int, answer: int,
               has_key: bool) -> list[str]:
    """`-c` overrides (TOML values) that add a provider for this daemon and select it."""
    overrides = [
        'model_provider="localllm"',
        'model_providers.localllm.name="localllm"',
        f'model_providers.localllm.base_url="{base_url}/v1"',
        'model_providers.localllm.wire_api="responses"',
        f'model="{model}"',
        f"model_context_window={n_ctx}",
        # it compacts before a turn whose answer would no longer fit
        f"model_auto_compact_token_limit={n_ctx - answer}",
        "analytics.enabled=false",
        "feedback.enabled=false",
        "check_for_update_on_startup=false",
    ]
    if has_key:
        overrides.append('model_providers.localllm.env_key="LOCALLLM_API_KEY"')
    return [arg for o in overrides for arg in ("-c", o)]


def copilot_env(base_url: str, model: str, token: str, n_ctx: int,
                answer: int) -> dict[str, str]:
    return {
        "COPILOT_PROVIDER_BASE_URL": f"{base_url}/v1",
        "COPILOT_PROVIDER_TYPE": "openai",
        "COPILOT_PROVIDER_WIRE_API": "completions",  # chat completions, in its words
        "COPILOT_PROVIDER_API_KEY": token,
        "COPILOT_MODEL": model,
        "COPILOT_PROVIDER_MAX_PROMPT_TOKENS": str(n_ctx - answer),
        "COPILOT_PROVIDER_MAX_OUTPUT_TOKENS": str(answer),
        "COPILOT_OFFLINE": "true",
        "COPILOT_AUTO_UPDATE": "false",
    }


def opencode_env(base_url: str, model: str, token: str, n_ctx: int,
                 answer: int, helper: str) -> dict[str, str]:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"localllm": {
            "npm": "@ai-sdk/openai-compatible", "name": "localllm",
            "options": {"baseURL": f"{base_url}/v1", "apiKey": token},
            "models": {name: {"name": name, "tool_call": True,
                              "limit": {"context": n_ctx, "output": answer}}
                       for name in dict.fromkeys((model, helper))}}},
        "model": f"localllm/{model}",
        "small_model": f"localllm/{helper}",
        "autoupdate": False,
        "share": "disabled",
    }
    return {"OPENCODE_CONFIG_CONTENT": json.dumps(config),
            "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1"}


def make_setup(agent: str, base_url: str, model: str, n_ctx: int, api_key: str,
               agent_args: list[str], first_request: int = 0, helper: str = "") -> Setup:
    """`n_ctx`: the context loaded; `first_request`: the agent's first request's tokens;
    `helper`: the model for its side requests (launch_helpers.py), the main one if empty."""
    token = api_key or PLACEHOLDER_TOKEN
    answer = answer_room(n_ctx, first_request)
    helper = helper or model
    if agent == "claude":
        return Setup(agent, model, n_ctx,
                     claude_env(base_url, model, token, n_ctx, answer, helper),
                     ["claude", "--model", model, *agent_args])
    if agent == "copilot":
        return Setup(agent, model, n_ctx, copilot_env(base_url, model, token, n_ctx, answer),
                     ["copilot", "--no-auto-update", *agent_args])
    if agent == "opencode":
        return Setup(agent, model, n_ctx,
                     opencode_env(base_url, model, token, n_ctx, answer, helper),
                     ["opencode", *agent_args])
    env = {"LOCALLLM_API_KEY": api_key} if api_key else {}
    return Setup(agent, model, n_ctx, env, [
        "codex", *codex_args(base_url, model, n_ctx, answer, bool(api_key)), *agent_args])


def tcp_base_url(config) -> str:
    host, port = config.tcp
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ---- the model -----------------------------------------------------------------------------
async def stored_models(client) -> list[dict]:
    """Each stored model with its size, capabilities and trained context (from /api/show)."""
    from localllm.client import DaemonError

    models = []
    for m in (await client.request("GET", "/api/tags")).get("models", []):
        try:
            show = await client.request("POST", "/api/show", {"model": m["model"]})
        except DaemonError:  # a damaged model is no candidate, and stops no other one
            continue
        info = show.get("model_info") or {}
        trained = next((v for k, v in info.items() if k.endswith(".context_length")), 0)
        models.append({"name": m["model"], "size": int(m.get("size") or 0),
                       "capabilities": show.get("capabilities") or [],
                       "trained_ctx": int(trained or 0)})
    return models


def pick_model(models: list[dict], free_vram: int, ram_room: int | None = None) -> dict:
    """The largest tool-capable model whose weights fit `free_vram`; where none does, the
    smallest that fits the GPU and the RAM together (a model mostly in RAM is slow, a smaller
    one less so); where even that is too large for `ram_room` (None: not checked), one line
    saying why instead of a model that cannot load (an 18.6 GB pick on a box with no GPU)."""
    tools = [m for m in models if "tools" in m["capabilities"]]
    if not tools:
        names = ", ".join(m["name"] for m in models) or "none"
        raise UserError(f"no stored model can call tools (stored: {names}); pull one, e.g. "
                        f"`localllm pull qwen3-coder`, or name one with --model")
    fitting = [m for m in tools if m["size"] <= free_vram]
    if fitting:
        return max(fitting, key=lambda m: (m["size"], m["name"]))
    smallest = min(tools, key=lambda m: (m["size"], m["name"]))
    if ram_room is not None and smallest["size"] > free_vram + ram_room:
        where = (f"{human_size(free_vram)} of free VRAM and {human_size(ram_room)} of RAM"
                 if free_vram else f"{human_size(ram_room)} of RAM and no GPU")
        raise UserError(f"no stored tool-capable model fits this machine ({where}); the "
                        f"smallest, {smallest['name']}, is {human_size(smallest['size'])}: pull "
                        f"a smaller one, or name one with --model")
    return smallest


async def choose_model(client, asked: str | None) -> dict:
    models = await stored_models(client)
    if asked:
        from localllm.client import DaemonError

        try:
            show = await client.request("POST", "/api/show", {"model": asked})
        except DaemonError as e:
            if e.status == 404:
                raise UserError(f"model '{asked}' is not stored; pull it with "
                                f"`localllm pull {asked}` (see `localllm list`)") from None
            raise
        found = next((m for m in models if m["name"] in (asked, f"{asked}:latest")), None)
        if found is None:  # a name the store resolves another way (an alias, a path)
            found = {"name": asked, "size": 0, "capabilities": show.get("capabilities") or [],
                     "trained_ctx": 0}
        if (show.get("model_info") or {}).get("general.architecture") == "remote":
            found = {**found, "remote": True}
        return found  # one that cannot call tools is refused when its request is counted
    from localllm.engine.hardware import probe_card
    from localllm.planner.budgets import ram_budget

    card = probe_card()
    return pick_model(models, card.free_vram_bytes if card.has_gpu else 0, ram_budget(card))


def wanted_context(model: dict, asked: int | None) -> tuple[int, str]:
    """The context to load with and, where it is less than asked, why."""
    want = asked or WANTED_CTX
    trained = model["trained_ctx"]
    if trained and want > trained:
        return trained, f"{model['name']} was trained on {trained} tokens; using all of them"
    return want, ""


async def load(client, model: str, n_ctx: int) -> str:
    """Load the model with `n_ctx` of context: "" when it loaded, else the daemon's reason."""
    from localllm.client import DaemonError

    try:
        await client.request("POST", "/api/generate", {
            "model": model, "prompt": "", "stream": False, "options": {"num_ctx": n_ctx}})
    except DaemonError as e:
        if e.status not in (400, 500, 507):
            raise
        return str(e)
    return ""


async def load_with_context(client, model: str, n_ctx: int) -> tuple[int, str]:
    """Load the model with `n_ctx` of context; where that does not fit, with what the tuner
    says fits. Returns the context loaded and a note when it is less than asked."""
    error = await load(client, model, n_ctx)
    if not error:
        return await loaded_context(client, model) or n_ctx, ""
    await client.request("POST", "/api/generate", {"model": model, "prompt": "",
                                                   "stream": False})
    loaded = await loaded_context(client, model)
    return loaded, (f"{n_ctx} tokens of context do not fit {model} on this card "
                    f"({error}); loaded with {loaded}, what fits")


async def fit_agent(client, model: dict, agent: str, n_ctx: int,
                    agent_args: list[str] = ()) -> tuple[int, Need, str]:
    """With the model loaded at `n_ctx`: count the agent's first request with it (with the
    tools `agent_args` leave it), and load it larger where `n_ctx` cannot hold that and an
    answer. Returns the context loaded, what the agent needs, and a note when it was loaded
    larger; refuses a model that cannot hold the agent at all."""
    from localllm.client import DaemonError

    name = model["name"]
    if model.get("remote"):  # its server knows its context; there is no template here
        return n_ctx, Need(AGENTS[agent][0], 0), ""
    try:
        need = Need(AGENTS[agent][0], await first_request_tokens(client, agent, name,
                                                               agent_args))
    except DaemonError as e:
        if e.status != 400:
            raise
        # What the agent's own first request would be answered (a model without tools).
        raise UserError(f"{name} cannot run {AGENTS[agent][0]}: {e}") from None
    check_trained(name, model["trained_ctx"], need)
    if n_ctx >= need.tokens:
        return n_ctx, need, ""
    wanted = min(need.context, model["trained_ctx"] or need.context)
    error = await load(client, name, wanted)
    if error:
        raise too_small_for_card(name, n_ctx, need, error)
    loaded = await loaded_context(client, name) or wanted
    return loaded, need, f"{need.why()}: loaded {name} with {loaded} tokens of context"


async def loaded_context(client, model: str) -> int:
    for m in (await client.request("GET", "/api/ps")).get("models", []):
        if m.get("model") == model or m.get("name") == model:
            return int(m.get("context_length") or 0)
    return 0


# ---- the command ---------------------------------------------------------------------------
def cmd_launch(args) -> int:
    from localllm.config import load_config

    agent_args = split_rest(args)
    dry = args.print_env or args.print_config
    executable = shutil.which(args.agent)
    if executable is None and not dry:
        name, install = AGENTS[args.agent]
        raise UserError(f"{name} is not installed ({args.agent} is not on PATH); install it "
                        f"with `{install}`")
    config = load_config()
    if os.environ.get("LOCALLLM_HOST"):
        config = replace(config, host=os.environ["LOCALLLM_HOST"])
    setup = asyncio.run(_prepare(config, args, agent_args, dry))
    if dry:
        print_setup(setup)
        return 0
    env = {**os.environ, **setup.env}
    print(f"launching {AGENTS[setup.agent][0]} with {setup.model} "
          f"({setup.n_ctx} tokens of context)", file=sys.stderr)
    os.execvpe(executable, [executable, *setup.argv[1:]], env)
    return 0  # not reached


async def _prepare(config, args, agent_args: list[str], dry: bool = False) -> Setup:
    from localllm.client import Client

    from .launch_helpers import alias_helpers, choose_helper, say_helpers

    async with Client(config) as client:
        await client.connect()
        model = await choose_model(client, args.model)
        n_ctx, note = wanted_context(model, args.ctx)
        n_ctx, load_note = await load_with_context(client, model["name"], n_ctx)
        n_ctx, need, fit_note = await fit_agent(client, model, args.agent, n_ctx, agent_args)
        note = fit_note or load_note or note
        if note:
            print(f"note: {note}", file=sys.stderr)
        helper = await choose_helper(client, args.helper_model, model["name"])
        say_helpers(args.agent, helper, model["name"],
                    await alias_helpers(client, args.agent, helper, dry))
    return make_setup(args.agent, tcp_base_url(config), model["name"], n_ctx, config.api_key,
                      agent_args, need.first_request, helper)


def print_setup(setup: Setup) -> None:
    for key, value in setup.env.items():
        print(f"export {key}={shlex.quote(value)}")
    print(shlex.join(setup.argv))
