"""Every module path (a folder, a slash, a .py file) that a comment, a docstring or a page of
the docs names is a file of this tree (issue 64: no comment naming a module that has moved). A
mention resolves from the checkout's root, from localllm/, or from any folder above the file
that names it (inside localllm/daemon/, the api folder's respond module is named from there)."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MENTION = re.compile(r"(?<![\w./~-])((?:[A-Za-z_][\w.-]*/)+[A-Za-z_]\w*\.py)\b")
# Files of other projects that the docs name: the installed llama-cpp-python binding.
ELSEWHERE = ("llama_cpp/",)


def _prose(path: Path):
    """(line, text) of what a reader reads: a page's lines; a module's comments and
    docstrings (not its other strings: a test's data may name files that are not ours)."""
    text = path.read_text()
    if path.suffix == ".md":
        yield from enumerate(text.split("\n"), 1)
        return
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            first = node.body[0].lineno
            yield from ((first + i, line)
                        for i, line in enumerate(node.body[0].value.value.split("\n")))


def _resolves(mention: str, path: Path) -> bool:
    bases = [ROOT, ROOT / "localllm", *(p for p in path.parents if p == ROOT or ROOT in p.parents)]
    return mention.startswith(ELSEWHERE) or any((base / mention).is_file() for base in bases)


def _read() -> list[Path]:
    return [*sorted(ROOT.glob("*.md")), *sorted(ROOT.glob("docs/*.md")), ROOT / "lab/README.md",
            *(p for folder in ("localllm", "scripts", "tests", "lab")
              for p in sorted((ROOT / folder).rglob("*.py")))]


def test_every_module_path_named_in_comments_and_docs_exists():
    stale = [f"{path.relative_to(ROOT)}:{line}: {m.group(1)}"
             for path in _read() for line, text in _prose(path)
             for m in MENTION.finditer(text) if not _resolves(m.group(1), path)]
    assert not stale, stale


def test_the_front_pages_stay_short_and_docs_hold_no_dated_runs():
    """Issue 64: a README and an architecture page a newcomer reads whole; the dated runs are
    the lab's (lab/runs/), not pages of the docs."""
    for page in (ROOT / "README.md", ROOT / "docs" / "architecture.md"):
        assert len(page.read_text()) <= 15_000, page.name
    dated = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*")
             if re.search(r"\d{4}-\d{2}-\d{2}", p.name)]
    assert not dated, dated
