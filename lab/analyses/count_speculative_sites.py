"""Where code decides on a speculative mode by its name, outside tests/ and scripts/ (issue #35).

    python -m lab.analyses.count_speculative_sites [repo root]

Read from the code's syntax trees (comments and docstrings do not count):
- a branch site: a function (or a module's top level) holding a comparison of an expression about
  speculation (its text names speculative, mode, asked or drafter) against a mode's name ("off",
  "lookup", "mtp", "draft", "auto"), a tuple of them, or a list of modes (SPECULATIVE_MODES,
  LOAD_MODES, RELOADING_DRAFTERS, SPECULATIVE_CHOICES, MODES); one per function.
- a mode list: a tuple, list or set literal naming two modes or more, or a dict keyed by them.
A decision that reads a mode's row (localllm/speculative.py) is not a site: that is the one place.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

MODES = {"off", "lookup", "mtp", "draft", "prompt-lookup"}
LISTS = {"SPECULATIVE_MODES", "LOAD_MODES", "RELOADING_DRAFTERS", "SPECULATIVE_CHOICES", "MODES"}
WORDS = ("specul", "mode", "asked", "drafter")


def names_modes(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in MODES | {"auto"}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(names_modes(e) for e in node.elts)
    if isinstance(node, ast.Name):
        return node.id in LISTS
    return isinstance(node, ast.Attribute) and node.attr in LISTS


def scope_of(tree: ast.AST, node: ast.AST) -> str:
    best = None
    for f in ast.walk(tree):
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and \
                f.lineno <= node.lineno <= (f.end_lineno or f.lineno) and \
                (best is None or f.lineno > best.lineno):
            best = f
    return best.name if best else "<module>"


def count(root: Path) -> tuple[list[str], list[str]]:
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "*.py"], check=True,
                            capture_output=True, text=True).stdout.split()
    sites: dict[tuple[str, str], int] = {}
    lists = []
    for path in (p for p in listed if not p.startswith(("tests/", "scripts/"))):
        source = (root / path).read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
                about = [p for p in parts if not names_modes(p)]
                if len(about) < len(parts) and any(
                        w in (ast.get_source_segment(source, p) or "").lower()
                        for p in about for w in WORDS):
                    sites.setdefault((path, scope_of(tree, node)), node.lineno)
            elif isinstance(node, ast.Tuple | ast.List | ast.Set | ast.Dict):
                items = node.keys if isinstance(node, ast.Dict) else node.elts
                named = [i.value for i in items
                         if isinstance(i, ast.Constant) and isinstance(i.value, str)]
                if sum(n in MODES | {"none"} for n in named) >= 2:
                    lists.append(f"{path}:{node.lineno}")
    return [f"{p}:{line} {scope}" for (p, scope), line in sites.items()], lists


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    sites, lists = count(root)
    for title, found in (("branch sites", sites), ("mode lists", lists)):
        files = {f.split(":")[0] for f in found}
        print(f"{title}: {len(found)} in {len(files)} files")
        for f in found:
            print(f"  {f}")


if __name__ == "__main__":
    main()
