"""Existing Modelfiles port: MESSAGE (stored and sent before the conversation), LICENSE (kept,
`show --license`), Ollama's parameters this engine lacks taken with a note, ADAPTER and
REQUIRES refused with a reason, and `show --modelfile` writing every parameter `show` lists."""

from __future__ import annotations

import json
import urllib.request

from test_ollama_habits import cli, one_line_error

MODELFILE = '''FROM smollm2
SYSTEM """You are a pirate."""
PARAMETER temperature 0
PARAMETER num_ctx 2048
PARAMETER num_keep 24
PARAMETER mirostat 2
MESSAGE user "What do pirates say?"
MESSAGE assistant """Arr, matey."""
LICENSE """Apache License 2.0 (test text)"""
'''


def _chat(daemon, model: str) -> dict:
    body = json.dumps({"model": model, "stream": False, "options": {"num_predict": 2},
                       "messages": [{"role": "system", "content": "You are a pirate."},
                                    {"role": "user", "content": "Hello"}]}).encode()
    req = urllib.request.Request(daemon.url + "/api/chat", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_a_modelfile_with_messages_license_and_ollama_parameters_ports(fresh_daemon, tmp_path):
    path = tmp_path / "Modelfile"
    path.write_text(MODELFILE)
    made = cli(fresh_daemon, "create", "pirate", "-f", str(path))
    assert made.returncode == 0, made.stderr
    assert "parameter num_keep left out" in made.stdout and "mirostat left out" in made.stdout
    assert cli(fresh_daemon, "show", "pirate", "--license").stdout.strip() == \
        "Apache License 2.0 (test text)"
    assert cli(fresh_daemon, "show", "pirate", "--system").stdout.strip() == "You are a pirate."
    parameters = cli(fresh_daemon, "show", "pirate", "--parameters").stdout
    assert "num_ctx" in parameters and "temperature" in parameters
    modelfile = cli(fresh_daemon, "show", "pirate", "--modelfile").stdout
    for line in ("PARAMETER num_ctx 2048", "PARAMETER temperature 0", "PARAMETER stop",
                 'MESSAGE user """What do pirates say?"""', 'MESSAGE assistant """Arr, matey."""',
                 'LICENSE """Apache License 2.0 (test text)"""'):
        assert line in modelfile, (line, modelfile)
    assert "num_keep" not in modelfile
    # the MESSAGEs go before the conversation: the same chat reads more tokens than on the base
    with_messages = _chat(fresh_daemon, "pirate")["prompt_eval_count"]
    without = _chat(fresh_daemon, "smollm2")["prompt_eval_count"]
    assert with_messages > without + 8
    # and the Modelfile `show` wrote builds the same model again
    rebuilt = tmp_path / "Rebuilt"
    rebuilt.write_text(modelfile.replace(modelfile.splitlines()[0], "", 1))
    again = cli(fresh_daemon, "create", "pirate2", "-f", str(rebuilt))
    assert again.returncode == 0, again.stderr


def test_adapter_and_requires_are_refused_with_a_reason(fresh_daemon, tmp_path):
    for line, fragment in (("ADAPTER ./lora.gguf", "LoRA adapters"),
                           ("REQUIRES 0.6.0", "REQUIRES names an Ollama version")):
        path = tmp_path / "Modelfile"
        path.write_text(f"FROM smollm2\n{line}\n")
        one_line_error(cli(fresh_daemon, "create", "nope", "-f", str(path)), fragment)
