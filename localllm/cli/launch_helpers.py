"""The helper models agents ask for besides their main one, for `localllm launch`.

Claude Code sends its side requests (titles, summaries) to its small fast model and opencode to
its `small_model`: both are names launch gives them. Copilot CLI (1.0.81 on) asks for an
internal `gpt-5.4-nano` whatever it is told, which exists only at its vendor: launch makes it
an alias here (the `model_aliases` setting in config.toml, which the daemon applies as soon as
the file changes), unless an alias already answers to it. The helper is the main model (loaded
already: no second model to fit beside it) or the one `--helper-model` names; launch says which.
"""

from __future__ import annotations

import asyncio
import sys
import time

from localllm.errors import UserError

# Names each agent asks for that no setting of its own can change: aliases on the daemon.
ALIASED = {"copilot": ("gpt-5.4-nano",)}
# What each agent calls its helper model, for the line launch prints.
HELPER_WORDS = {"claude": "Claude Code's small fast model", "opencode": "opencode's small_model",
                "copilot": "Copilot CLI's gpt-5.4-nano"}
ALIAS_WAIT_S = 10.0  # for the daemon to read the edited config.toml


async def choose_helper(client, asked: str | None, main: str) -> str:
    """The model helper requests go to: `asked` (which must be stored), else the main one."""
    if not asked:
        return main
    from localllm.client import DaemonError

    try:
        await client.request("POST", "/api/show", {"model": asked})
    except DaemonError as e:
        if e.status == 404:
            raise UserError(f"helper model '{asked}' is not stored; pull it with "
                            f"`localllm pull {asked}` (see `localllm list`)") from None
        raise
    return asked


async def alias_helpers(client, agent: str, helper: str, dry: bool) -> list[str]:
    """Make the names `agent` asks for regardless of its settings answer with `helper`:
    added to config.toml's model_aliases (not with `dry`) unless an alias answers already.
    Returns what it did, in words."""
    from localllm.config import config_file, parse_config, read_config_text, with_setting
    from localllm.daemon.aliases import alias_target

    said = []
    for name in ALIASED.get(agent, ()):
        aliases = (await client.request("GET", "/api/tags")).get("aliases") or {}
        known = alias_target(aliases, name)
        if known is not None:
            said.append(f"{name} -> {known} (model_aliases already has it)")
            continue
        path = config_file()
        if dry:
            said.append(f"{name} -> {helper} (would be added to model_aliases in {path})")
            continue
        text = read_config_text(path) if path.is_file() else ""
        ours = parse_config(text, str(path)).get("model_aliases", {}) if text else {}
        path.parent.mkdir(parents=True, exist_ok=True)
        edited = with_setting(text, "model_aliases", {**ours, name: helper}, str(path))
        temporary = path.with_name(path.name + ".launch")
        temporary.write_text(edited)
        temporary.replace(path)  # the daemon never reads half a file
        await _until_aliased(client, name)
        said.append(f"{name} -> {helper} (added to model_aliases in {path})")
    return said


async def _until_aliased(client, name: str) -> None:
    """Wait (ALIAS_WAIT_S at most) for the daemon to answer to `name`."""
    from localllm.daemon.aliases import alias_target

    deadline = time.monotonic() + ALIAS_WAIT_S
    while time.monotonic() < deadline:
        aliases = (await client.request("GET", "/api/tags")).get("aliases") or {}
        if alias_target(aliases, name) is not None:
            return
        await asyncio.sleep(0.1)
    raise UserError(f"the daemon did not take the alias {name!r} from config.toml within "
                    f"{ALIAS_WAIT_S:.0f}s (is it running with another config folder, or with "
                    f"LOCALLLM_MODEL_ALIASES set?)")


def say_helpers(agent: str, helper: str, main: str, aliased: list[str]) -> None:
    """The one line that says where the agent's helper requests go."""
    if agent not in HELPER_WORDS:
        return
    which = "the main model" if helper == main else "--helper-model"
    print(f"helper model: {HELPER_WORDS[agent]} answers with {helper} ({which})"
          + "".join(f"; alias {line}" for line in aliased), file=sys.stderr)
