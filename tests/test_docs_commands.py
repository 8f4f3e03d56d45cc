"""The README, docs/api.md and `--help` say what the commands do: every command's help prints,
and every command of the README and of the API page (where the curl examples moved) that
needs no network runs against a real daemon without an error."""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import pytest

from localllm.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The pages whose sh blocks run, in this order: the API page ends by deleting the model.
PAGES_WITH_COMMANDS = (README, ROOT / "docs" / "api.md")
ANSWER_CAP = 48  # tokens: past the JSON of the structured-output example


def command_paths(parser: argparse.ArgumentParser, prefix=()) -> list[tuple[str, ...]]:
    paths = []
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append((*prefix, name))
                paths += command_paths(sub, (*prefix, name))
    return paths


def test_every_command_and_subcommand_prints_its_help(capsys):
    paths = command_paths(build_parser())
    assert ("remote", "list") in paths and ("config", "unset") in paths and ("eval",) in paths
    for path in [(), *paths]:
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        out = capsys.readouterr()
        assert exit_.value.code == 0, path
        assert out.out.startswith("usage: localllm") and "Traceback" not in out.err, path


def readme_commands() -> list[str]:
    """Lines of the pages' sh blocks that run against the daemon's stored smollm2 alone."""
    blocks = [block for page in PAGES_WITH_COMMANDS
              for block in re.findall(r"```sh\n(.*?)```", page.read_text(), flags=re.S)]
    lines = [line.split("   #")[0].strip() for block in blocks for line in block.splitlines()]
    wanted = []
    for line in lines:
        if not line.startswith(("curl ", "localllm ")):
            continue  # install, build and benchmark commands: not for a test
        models = re.findall(r'"model": "([^"]+)"', line) + re.findall(r"localllm \w+ (\S+)",
                                                                        line)
        if all(m == "smollm2" for m in models):  # others would be pulled from the network
            wanted.append(line)
    return wanted


def test_readme_commands_run_without_an_error(fresh_daemon, tmp_path):
    commands = readme_commands()
    assert len(commands) >= 10 and any("DELETE" in c for c in commands)
    assert "DELETE" in commands[-1], "the delete example comes after those that use the model"
    d = fresh_daemon
    address = d.url.removeprefix("http://")
    # Most examples set no answer length, and a small model may write until its context is
    # full (one ran past 10 minutes on a busy machine). What is checked is that each command
    # runs without an error, so the stored model caps its answers as a Modelfile can.
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM smollm2\nPARAMETER num_predict {ANSWER_CAP}\n")
    capped = d.cli("create", "smollm2", "--force", "-f", str(modelfile))
    assert capped.returncode == 0, capped.stderr
    for command in commands:
        command = (command.replace("localhost:11435", address)
                   .replace("$XDG_RUNTIME_DIR/localllm/localllm.sock", str(d.socket)))
        if command.startswith("localllm "):
            result = d.cli(*_words(command.removeprefix("localllm ")), timeout=600)
        else:
            result = subprocess.run(["bash", "-c", command], env=d.env, capture_output=True,
                                    text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, (command, result.stderr)
        assert "Traceback" not in result.stderr and '"error"' not in result.stdout, command
        assert result.stdout.strip() or "DELETE" in command, command


def _words(text: str) -> list[str]:
    import shlex

    return shlex.split(text)


def test_the_readme_is_short_and_its_links_lead_somewhere():
    text = README.read_text()
    assert len(text) <= 15_000, f"the README is {len(text)} characters"
    links = re.findall(r"\]\((docs/[^)#]+)\)", text)
    assert {"docs/api.md", "docs/settings.md", "docs/tuner.md", "docs/security.md"} <= set(links)
    for link in links:
        assert (ROOT / link).exists(), link
