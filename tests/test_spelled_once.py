"""Issue 64's debts: the KV types, the load options and the speculative modes are each spelled in
one place (localllm/kv_types.py, localllm/options.py, localllm/speculative.py); everything else
reads them from there. A tuple, list or set of two words or more of one vocabulary, anywhere else
in the product, is a copy that the next new word would miss. (Tables keyed by a type, such as
measured speeds per KV type, are lookups that fail loudly on a new word, not copies.)"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from localllm import kv_types, speculative
from localllm.options import LoadOptions, reloads

ROOT = Path(__file__).resolve().parent.parent
VOCABULARIES = {
    "KV types": (set(kv_types.KV_TYPES) | set(kv_types.KV_SETTINGS), "localllm/kv_types.py"),
    "load options": ({f.name for f in fields(LoadOptions)}, "localllm/options.py"),
    "speculative modes": (set(speculative.SPECULATIVE_MODES) | set(speculative.ALIASES),
                          "localllm/speculative.py"),
}
# The projector files a pull prefers are GGUF file types that share names with KV types.
NOT_THESE_WORDS = {"localllm/modelstore/hub.py": "KV types"}


def test_each_vocabulary_is_spelled_in_one_place():
    copies = []
    for path in sorted((ROOT / "localllm").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                continue
            words = {e.value for e in node.elts
                     if isinstance(e, ast.Constant) and isinstance(e.value, str)}
            for name, (vocabulary, home) in VOCABULARIES.items():
                if where not in (home,) and NOT_THESE_WORDS.get(where) != name \
                        and len(words & vocabulary) >= 2:
                    copies.append(f"{where}:{node.lineno} spells {name} {sorted(words)}")
    assert not copies, copies


def test_the_load_options_are_what_reloads_the_model():
    """The TUI's "the model reloads" note and a request's LoadOptions read one rule."""
    for field in fields(LoadOptions):
        if field.name != "speculative":
            assert reloads(field.name, 4096 if field.name != "draft_model" else "m"), field.name
    assert not reloads("num_gpu", -1) and not reloads("num_thread", 0)  # "the tuner decides"
    assert all(reloads("speculative", m) for m in speculative.LOAD_MODES)
    assert not reloads("speculative", "lookup") and not reloads("temperature", 0.5)
