"""The house's rules, read from the code's own imports (no module is imported here).

Every folder of localllm/ is a room, and its import name is its path (localllm/engine/ is
`localllm.engine`): the checkout is the package.

- the base floor (the files of localllm/ itself: config, paths, errors, options, the client)
  imports nothing else of ours;
- nothing imports the commands room (cli/), which stands on the top floor;
- the rooms stand on floors (FLOORS): a room imports only rooms on its own floor or below;
- only the engine (engine/) imports llama.cpp, NVML or ctypes;
- the local engine (engine/local.py, the runner process) is imported, outside the engine, by the
  daemon's starter alone; the rest of the daemon, the remote engine first, reads the engine's
  face (ENGINE_FACE: its protocol, the Load, the card facts), never its insides;
- the tuning service (profiles/) touches the engine only through its child program: the probe
  runs (engine/probing.py) and their values;
- no two rooms import each other, directly or around a loop;
- inside a room, no two modules import each other around a loop, deferred (function-level)
  and type-checking imports included: a loop held open by a late import is still a loop;
- a child program of ours (`python -m localllm.X`) is named only by a module declared for it
  in CHILD_PROGRAMS (the runner, the engine's one child program, whose protocol names its
  command for the daemon and the tuner; the template worker), from a room on the same floor as
  the program's or above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "localllm"
ENGINE_MODULES = ("llama_cpp", "pynvml", "ctypes")
# Each room's floor, the base floor 0: a room imports rooms of its own floor or below, and starts
# child programs of its own floor or below. The store reads models; pure planning (planner/)
# plans from their shapes; the engine builds and runs what a plan says; the tuning service
# (profiles/) asks the engine's child program and keeps what it learns; the daemon and the chat
# screen above all of it, the commands room on top.
FLOORS = {"localllm": 0, "modelstore": 1, "planner": 2, "engine": 3, "profiles": 4, "daemon": 5,
          "tui": 5, "cli": 6}
# What the rooms above the engine may import of it: the engine seam and its protocol (requests,
# events, the op table), the Load, the probe runs and their values, and the card facts (NVML,
# the CPU, RPC workers) the planner is fed with. The local engine (local.py) is the starter's.
ENGINE_FACE = ("localllm.engine.seam", "localllm.engine.runner.protocol",
               "localllm.engine.runner.load", "localllm.engine.probes",
               "localllm.engine.probing", "localllm.engine.hardware", "localllm.engine.nvml",
               "localllm.engine.expert_cache", "localllm.engine.rpc")
LOCAL_ENGINE = "localllm.engine.local"
LOCAL_ENGINE_STARTERS = {"localllm/daemon/starting.py"}
REMOTE_ENGINE = "localllm/daemon/remote.py"


def _package(path: Path) -> str:
    inner = path.relative_to(ROOT).with_suffix("").parts
    if inner[-1] == "__init__":
        inner = inner[:-1]
    return ".".join(inner)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, as an absolute dotted name (lazy imports too)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _package(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _room_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "localllm":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else "localllm"


def _room_of_path(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else "localllm"


def _sources() -> dict[Path, set[str]]:
    return {path: _imports(path) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_in(module: str, names) -> bool:
    return any(module == n or module.startswith(n + ".") for n in names)


def test_every_folder_is_a_room_on_a_floor():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(FLOORS) - {"localllm"}, folders


def test_the_base_floor_imports_nothing_else_of_ours():
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) == "localllm"
             for m in modules if _room_of(m) not in (None, "localllm")]
    assert not wrong, wrong


def test_nothing_imports_the_commands_room():
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) != "cli"
             for m in modules if _room_of(m) == "cli"]
    assert not wrong, wrong


def test_imports_go_down_the_floors():
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() for m in modules
             if (r := _room_of(m)) is not None and FLOORS[r] > FLOORS[_room_of_path(p)]]
    assert not wrong, wrong


def test_only_the_engine_imports_llama_cpp_nvml_or_ctypes():
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) != "engine"
             for m in modules if m.split(".")[0] in ENGINE_MODULES]
    assert not wrong, wrong


def test_only_the_daemons_starter_imports_the_local_engine():
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) != "engine"
             and str(p.relative_to(ROOT)) not in LOCAL_ENGINE_STARTERS
             for m in modules if _is_in(m, (LOCAL_ENGINE,))]
    assert not wrong, wrong


def test_the_rooms_above_read_the_engines_face_only():
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) != "engine"
             and str(p.relative_to(ROOT)) not in LOCAL_ENGINE_STARTERS
             for m in modules if _room_of(m) == "engine" and m != "localllm.engine"
             and not _is_in(m, ENGINE_FACE)]
    assert not wrong, wrong


def test_the_remote_engine_imports_the_engines_protocol_only():
    modules = _imports(ROOT / REMOTE_ENGINE)
    wrong = sorted(m for m in modules if _room_of(m) == "engine" and not _is_in(
        m, ("localllm.engine.seam", "localllm.engine.runner.protocol")))
    assert not wrong, wrong


def test_the_tuning_service_touches_the_engine_only_through_its_child_program():
    """It asks the runner through the probe runs (engine/probing.py) with their values;
    llama.cpp, NVML and the engine's modules load in that child alone, never in the daemon or
    the CLI through it."""
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) == "profiles"
             for m in modules if _room_of(m) == "engine" and not _is_in(
                 m, ("localllm.engine.probes", "localllm.engine.probing",
                     "localllm.engine.runner.protocol"))]
    assert not wrong, wrong


def test_pure_planning_reads_only_the_base_floor_and_model_shapes():
    """The planner is pure: from a shape, a card and a request to a plan."""
    wrong = [f"{p.relative_to(ROOT)} imports {m}"
             for p, modules in _sources().items() if _room_of_path(p) == "planner"
             for m in modules if _room_of(m) not in (None, "localllm", "planner")
             and not _is_in(m, ("localllm.modelstore.shape",))]
    assert not wrong, wrong


def test_no_rooms_import_each_other_around_a_loop():
    arrows: dict[str, set[str]] = {}
    for path, modules in _sources().items():
        room = _room_of_path(path)
        arrows.setdefault(room, set()).update(
            r for m in modules if (r := _room_of(m)) not in (None, room))

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in arrows.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    loops = sorted(room for room in arrows if reaches(room, room, {room}))
    assert not loops, {room: sorted(arrows[room]) for room in loops}



def _module_arrows() -> dict[Path, set[Path]]:
    """Each file -> the files of its own room it imports (lazy and type-checking imports too).
    `from . import keys` is an arrow to keys.py, not to the package's __init__.py."""
    files = {_package(path): path for path in sorted(PACKAGE.rglob("*.py"))}

    def file_of(name: str) -> Path | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return files.get(name)

    arrows: dict[Path, set[Path]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(file_of(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1])
                    module = f"{base}.{module}" if module else base
                for alias in node.names:
                    found.add(files.get(f"{module}.{alias.name}") or file_of(module))
        room = _room_of_path(path)
        arrows[path] = {f for f in found
                        if f is not None and f != path and _room_of_path(f) == room}
    return arrows


def test_no_modules_import_each_other_around_a_loop_inside_a_room():
    arrows = _module_arrows()

    def loop_from(start: Path) -> list[Path] | None:
        """A path of arrows from `start` back to itself, if there is one."""
        stack, seen = [[start]], {start}
        while stack:
            trail = stack.pop()
            for nxt in sorted(arrows[trail[-1]]):
                if nxt == start:
                    return trail
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append([*trail, nxt])
        return None

    loops = sorted({" -> ".join(str(p.relative_to(ROOT)) for p in (*trail, trail[0]))
                    for start in sorted(arrows) if (trail := loop_from(start))
                    and trail[0] == min(trail)})
    assert not loops, loops


def test_no_file_over_500_lines_and_no_class_over_300():
    """Issue #35's bounds: a module a reader can hold, a class that owns one thing."""
    long_files, long_classes = [], []
    for path in _sources():
        text = path.read_text()
        if text.count("\n") > 500:
            long_files.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 300:
                long_classes.append(f"{path.relative_to(ROOT)} {node.name}: "
                                    f"{node.end_lineno - node.lineno} lines")
    assert not long_files, long_files
    assert not long_classes, long_classes


# Each child program of ours (`python -m localllm.X`) and the modules that start it: a child
# program is a dependency the import graph does not see, so a new one is declared here. The
# runner is the engine's one child program: the daemon's runners and the tuner's measurements
# (engine/runner/tuner_ops.py) are its ops. The CLI is no child program: the daemon is started
# as the installed `localllm` command (localllm/client.py's serve_command), as a unit file would.
CHILD_PROGRAMS = {
    "localllm.engine.runner": {"localllm/engine/runner/protocol.py"},
    "localllm.daemon.chat.template_worker": {"localllm/daemon/chat/template.py"},
}


def _module_targets(tree: ast.AST) -> list[str]:
    """Every "localllm..." string that follows a "-m" in a list, tuple or call of this code."""
    found = []
    for node in ast.walk(tree):
        items = node.elts if isinstance(node, (ast.List, ast.Tuple)) else \
            node.args if isinstance(node, ast.Call) else []
        for flag, target in zip(items, items[1:], strict=False):
            if isinstance(flag, ast.Constant) and flag.value == "-m" and \
                    isinstance(target, ast.Constant) and isinstance(target.value, str) and \
                    target.value.split(".")[0] == "localllm":
                found.append(target.value)
    return found


def test_child_programs_are_started_only_where_declared():
    wrong = []
    for path in _sources():
        where = str(path.relative_to(ROOT))
        for target in _module_targets(ast.parse(path.read_text(), where)):
            if where not in CHILD_PROGRAMS.get(target, ()):
                wrong.append(f"{where} starts `python -m {target}`")
    assert not wrong, wrong


def test_child_programs_are_started_from_their_floor_or_above():
    """A starter below its program depends on a room above it, unseen by the imports."""
    wrong = []
    for path in _sources():
        where = _room_of_path(path)
        for target in _module_targets(ast.parse(path.read_text(), str(path))):
            if FLOORS[_room_of(target)] > FLOORS[where]:
                wrong.append(f"{path.relative_to(ROOT)} ({where}, floor {FLOORS[where]}) starts "
                             f"`python -m {target}` ({_room_of(target)}, floor "
                             f"{FLOORS[_room_of(target)]})")
    assert not wrong, wrong


def _sys_path_edits(path: Path) -> list[int]:
    """Lines of `path` that change sys.path (insert, append, a slice or a new list)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        target = node.func.value if isinstance(node, ast.Call) and isinstance(
            node.func, ast.Attribute) else None
        targets = [t.value if isinstance(t, ast.Subscript) else t
                   for t in node.targets] if isinstance(node, ast.Assign) else [target]
        if any(isinstance(t, ast.Attribute) and t.attr == "path" and isinstance(t.value, ast.Name)
               and t.value.id == "sys" for t in targets):
            lines.append(node.lineno)
    return lines


def test_the_checkout_is_the_package_no_sys_path_lines():
    """Scripts, the lab and the tests run as modules of the checkout (`python -m
    scripts.bench.bench_session`, pytest's pythonpath): none edits sys.path to find another."""
    wrong = [f"{path.relative_to(ROOT)}:{line}"
             for folder in ("localllm", "scripts", "lab", "tests")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for line in _sys_path_edits(path)]
    assert not wrong, wrong


def test_nothing_outside_the_lab_imports_it():
    wrong = [f"{path.relative_to(ROOT)} imports {m}"
             for folder in ("localllm", "scripts", "tests")
             for path in sorted((ROOT / folder).rglob("*.py"))
             for m in _imports_anywhere(path) if m.split(".")[0] == "lab"]
    assert not wrong, wrong


def _imports_anywhere(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
    return found


def test_the_engines_class_names_mean_one_class():
    """The engine's words name one class each in the whole product (there were two `Engine`s,
    the seam's protocol and the runner's loop, and two `LoadedModel`s, the runner's model and
    the scheduler's record): a reader who meets the name knows which it is."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(ROOT)))
    engine = str(PACKAGE.relative_to(ROOT) / "engine") + "/"
    twice = {name: paths for name, paths in where.items()
             if len(paths) > 1 and any(p.startswith(engine) for p in paths)}
    assert not twice, twice
