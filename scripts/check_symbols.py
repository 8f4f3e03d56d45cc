"""Check that a llama.cpp build exports every C function that is bound to it by name.

    .venv/bin/python -m scripts.check_symbols [LIB_DIR]

LIB_DIR defaults to the lib folder of the installed `llama_cpp`. The names come from the
sources, read with `ast`, not from a list kept by hand:
- llama-cpp-python's bindings: `ctypes_function("name", ...)` and `_lib.name` in
  llama_cpp.py (libllama), mtmd_cpp.py (libmtmd), and the alternatives of
  `_ctypes_function_from_names` in llama_cpp_ext.py (one of them must be there);
- the project's own ctypes loads: every `ggml_*` / `llama_*` name in a module of this repository
  that calls `ctypes.CDLL` on a `lib*.so`, looked up in the libraries that module names.
A name counts as exported when `nm -D --defined-only` lists it in the library or in one of its
DT_NEEDED libraries from the same folder (dlsym on a handle searches those too). The check
matters for builds that leave parts out (scripts/llama_cmake_trim.cmake, scripts/build_wheel.sh):
a missing name would only show when that code path first runs.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SYMBOL = re.compile(r"^(ggml|gguf|llama|mtmd)_\w+$")


def exported(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True,
                         capture_output=True, text=True).stdout
    return {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}


def needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], check=True, capture_output=True,
                         text=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def visible(lib_dir: Path, name: str) -> set[str]:
    """What dlsym finds through a handle of lib_dir/name: it and its in-folder dependencies."""
    seen: set[str] = set()
    symbols: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen or not (lib_dir / current).is_file():
            continue
        seen.add(current)
        symbols |= exported(lib_dir / current)
        todo += needed(lib_dir / current)
    return symbols


def _string_arg(call: ast.Call) -> str | None:
    if call.args and isinstance(call.args[0], ast.Constant) and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def binding_names(source: str) -> tuple[set[str], list[tuple[str, ...]]]:
    """(names that must all exist, groups of which one must exist) bound in a binding module."""
    required: set[str] = set()
    any_of: list[tuple[str, ...]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "ctypes_function" and (name := _string_arg(node)):
                required.add(name)
            elif node.func.id == "_ctypes_function_from_names" and node.args and isinstance(
                    node.args[0], ast.Tuple):
                any_of.append(tuple(e.value for e in node.args[0].elts
                                    if isinstance(e, ast.Constant)))
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in ("_lib", "_libmtmd") and SYMBOL.match(node.attr)):
            required.add(node.attr)
    return required, any_of


def project_loads(path: Path) -> tuple[set[str], set[str]]:
    """(libraries, C names) of a project module that opens llama.cpp's libraries with ctypes."""
    source = path.read_text()
    if "ctypes.CDLL" not in source:
        return set(), set()
    tree = ast.parse(source)
    handles = {target.id for node in ast.walk(tree)
               if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
               and ast.unparse(node.value.func) == "ctypes.CDLL"
               for target in node.targets if isinstance(target, ast.Name)}
    libs: set[str] = set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"lib[\w-]+\.so", node.value):
                libs.add(node.value)
            elif SYMBOL.match(node.value):
                names.add(node.value)
        elif (isinstance(node, ast.Attribute) and SYMBOL.match(node.attr)
              and isinstance(node.value, ast.Name) and node.value.id in handles):
            names.add(node.attr)
    return libs, names


def project_dirs() -> list[Path]:
    """The package (localllm/) and scripts/."""
    return [REPO / "localllm", REPO / "scripts"]


def check(lib_dir: Path, package_dir: Path) -> list[str]:
    """Every problem found, one line each; empty when all names are exported."""
    problems: list[str] = []
    counted = 0
    for module, lib in (("llama_cpp.py", "libllama.so"), ("mtmd_cpp.py", "libmtmd.so"),
                        ("llama_cpp_ext.py", "libllama.so")):
        if not (lib_dir / lib).is_file():
            problems.append(f"{lib}: not in {lib_dir}")
            continue
        symbols = visible(lib_dir, lib)
        required, any_of = binding_names((package_dir / module).read_text())
        counted += len(required) + len(any_of)
        problems += [f"{module}: {name} not exported by {lib}"
                     for name in sorted(required - symbols)]
        problems += [f"{module}: none of {', '.join(group)} exported by {lib}"
                     for group in any_of if not symbols.intersection(group)]
    for folder in project_dirs():
        for path in sorted(folder.rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            libs, names = project_loads(path)
            if not libs or not names:
                continue
            symbols: set[str] = set()
            for lib in sorted(libs):
                if not (lib_dir / lib).is_file():
                    problems.append(f"{path.relative_to(REPO)}: loads {lib}, not in {lib_dir}")
                symbols |= visible(lib_dir, lib)
            counted += len(names)
            where = f"{path.relative_to(REPO)}: %s not exported by {', '.join(sorted(libs))}"
            problems += [where % name for name in sorted(names - symbols)]
    print(f"{counted} bound names checked against {lib_dir}: {len(problems)} missing")
    return problems


def main() -> int:
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        print("error: llama_cpp is not installed in this Python", file=sys.stderr)
        return 1
    package_dir = Path(spec.origin).parent
    lib_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else package_dir / "lib"
    problems = check(lib_dir, package_dir)
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
