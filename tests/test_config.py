"""config.toml + LOCALLLM_* env: precedence, errors with file and line, the documented table,
and `localllm config show|set|unset|edit` run through the real CLI."""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import fields

import pytest

from localllm import config as cfg
from localllm.cli.main import main
from localllm.config import Config, ConfigError, load_config, load_config_sources, with_setting


def test_defaults_file_then_env_and_where_each_came_from(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('keep_alive = "10m"\nmax_queue = 8\n')
    config, sources = load_config_sources(path, {"LOCALLLM_MAX_QUEUE": "3"})
    assert config.keep_alive == "10m" and sources["keep_alive"] == "file"
    assert config.max_queue == 3 and sources["max_queue"] == "LOCALLLM_MAX_QUEUE"
    assert config.num_parallel == "auto" and sources["num_parallel"] == "default"
    assert load_config(tmp_path / "absent.toml", {}) == Config()


def test_docstring_table_is_the_truth():
    """The one env table in config.py's docstring lists every setting, its env and its default."""
    rows = re.findall(r"^\| (\w+)\s+\| (\w+)\s+\| ([^|]+?)\s+\| ([^|]+?)\s+\|$",
                      cfg.__doc__, re.MULTILINE)
    table = {name: (env, default, applied) for name, env, default, applied in rows
             if name != "setting"}
    assert list(table) == [f.name for f in fields(Config)]
    for f in fields(Config):
        env, default, applied = table[f.name]
        assert env == cfg.ENV[f.name]
        value = getattr(Config(), f.name)  # a table's default comes from its factory
        if value != "":
            assert default == str(value), f.name
        assert (applied == "restart") == (f.name in cfg.RESTART_NEEDED), f.name


@pytest.mark.parametrize("text, line, reason", [
    ('keep_alive = "5m"\nmax_queue = 0\n', 2, "max_queue must be at least 1"),
    ('\n\nmax_queue = "many"\n', 3, "max_queue must be a whole number"),
    ('host = "x"\nkeepalive = "5m"\n', 2, "unknown setting 'keepalive'"),
    ('kv_cache_type = "q5_1"\n', 1, "kv_cache_type must be one of auto, f16, bf16, q8_0, q4_0"),
    ('keep_alive = "soon"\n', 1, "invalid duration 'soon'"),
    ('socket = "relative.sock"\n', 1, "socket must be an absolute path"),
    ('max_queue = 4\nkeep_alive = "5m\n', 2, "Illegal character"),
    ('api_key = true\n', 1, "api_key must be text"),
])
def test_a_bad_file_is_reported_with_line_and_reason(tmp_path, text, line, reason):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, {})
    error = caught.value
    assert error.line == line and error.path == str(path)
    assert reason.lower() in error.reason.lower()
    assert str(error).startswith(f"{path}:{line}: ")


def test_a_bad_environment_value_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="LOCALLLM_NUM_PARALLEL.*at most 64"):
        load_config(tmp_path / "none.toml", {"LOCALLLM_NUM_PARALLEL": "65"})


def test_with_setting_keeps_comments_and_layout():
    text = "# my settings\nkeep_alive = \"5m\"  # long enough\n\n# queue\nmax_queue = 8\n"
    edited = with_setting(text, "max_queue", "16")
    assert edited == text.replace("max_queue = 8", "max_queue = 16")
    added = with_setting(edited, "default_model", "gemma3")
    assert added.endswith('max_queue = 16\ndefault_model = "gemma3"\n')
    assert with_setting(added, "keep_alive", None) == \
        "# my settings\n\n# queue\nmax_queue = 16\ndefault_model = \"gemma3\"\n"
    with pytest.raises(ConfigError, match="at least 1"):
        with_setting(text, "max_queue", "0")


def test_config_set_show_unset_through_the_cli(home, capsys, monkeypatch):
    monkeypatch.delenv("LOCALLLM_MAX_QUEUE", raising=False)
    assert main(["config", "set", "max_queue", "12"]) == 0
    assert main(["config", "set", "host", "127.0.0.1:12000"]) == 0
    out = capsys.readouterr().out
    assert "restarted" in out  # host is only taken at restart, and set says so
    assert cfg.config_file().read_text() == 'max_queue = 12\nhost = "127.0.0.1:12000"\n'

    monkeypatch.setenv("LOCALLLM_KEEP_ALIVE", "1h")
    assert main(["config", "show"]) == 0
    shown = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
             if not line.startswith("#")}
    assert shown["max_queue"][1:] == ["12", "file"]
    assert shown["keep_alive"][1:] == ["1h", "env", "LOCALLLM_KEEP_ALIVE"]
    assert shown["num_parallel"][1:] == ["auto", "default"]

    assert main(["config", "set", "max_queue", "none"]) == 1
    assert "max_queue must be a whole number" in capsys.readouterr().err
    assert main(["config", "unset", "host"]) == 0
    assert cfg.config_file().read_text() == "max_queue = 12\n"


def _editor(tmp_path, content: str) -> str:
    """A real editor program: it writes `content` into the file it is given."""
    script = tmp_path / "editor.py"
    script.write_text(f"import sys\nopen(sys.argv[1], 'w').write({content!r})\n")
    return f"{sys.executable} {script}"


def test_config_edit_saves_a_valid_edit_and_refuses_a_broken_one(home, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.delenv("VISUAL", raising=False)
    path = cfg.config_file()
    path.parent.mkdir(parents=True)
    path.write_text("max_queue = 8\n")
    monkeypatch.setenv("EDITOR", _editor(tmp_path, "max_queue = 9\nnum_parallel = 2\n"))
    assert main(["config", "edit"]) == 0
    assert load_config(path, {}).num_parallel == 2

    not_a_terminal = (tmp_path / "stdin").open("w+")  # so no "edit again?" question
    monkeypatch.setattr(sys, "stdin", not_a_terminal)
    broken = textwrap.dedent("""\
        max_queue = 9
        num_parallel = "two"
    """)
    monkeypatch.setenv("EDITOR", _editor(tmp_path, broken))
    assert main(["config", "edit"]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: num_parallel must be a whole number" in err and "unchanged" in err
    assert path.read_text() == "max_queue = 9\nnum_parallel = 2\n"
    not_a_terminal.close()
