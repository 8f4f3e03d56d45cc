"""docs/settings.md is generated from the settings table in localllm/config.py: it fails here
when the table changed and the page was not written again (scripts/settings_doc.py)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

from scripts import settings_doc

from localllm.config import ENV, Config

ROOT = Path(__file__).resolve().parent.parent


def test_the_settings_page_is_what_the_config_table_generates():
    result = subprocess.run([sys.executable, "-m", "scripts.settings_doc", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    page = (ROOT / "docs" / "settings.md").read_text()
    assert page == settings_doc.render(settings_doc.config_docstring())


def test_the_page_names_every_setting_and_its_variable():
    page = (ROOT / "docs" / "settings.md").read_text()
    for field in fields(Config):
        assert f"| `{field.name}` | `{ENV[field.name]}` |" in page, field.name
    assert set(settings_doc.OLLAMA_TWINS) <= {f.name for f in fields(Config)}


def test_a_changed_table_changes_the_page():
    doc = settings_doc.config_docstring()
    changed = doc.replace("| 4096                          |", "| 8192                          |")
    assert changed != doc
    assert settings_doc.render(changed) != settings_doc.render(doc)
    assert "| `default_ctx` | `LOCALLLM_CONTEXT_LENGTH` | 8192 |" in settings_doc.render(changed)
