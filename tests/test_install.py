"""scripts/install.sh: llama.cpp built once per machine and reused by every later venv, the
trimmed build still exports every C function bound by name, and a release wheel installs and
answers without a compiler.

The installs run the real script into fresh copies of this checkout, with the compilers on PATH
replaced by commands that log their call and fail, so "compiles nothing" is checked, not timed.
They reuse the wheel that this machine's own `scripts/install.sh` built (scripts/test.sh and
CI run it first); without one they skip rather than compile llama.cpp inside a test.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import import_models
from daemon_process import isolated_env

ROOT = Path(__file__).resolve().parent.parent
INSTALL = ROOT / "scripts" / "install.sh"
COMPILERS = ("cc", "gcc", "g++", "c++", "cmake", "ninja", "make", "ld")
LLAMA_CPP_VERSION = "0.3.36"


def checkout_copy(dest: Path) -> Path:
    """This checkout's files (tracked and new, never ignored ones like .venv): a fresh place for
    install.sh to make its .venv."""
    listed = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def no_compiler_env(shims: Path, **extra: str) -> tuple[dict, Path]:
    """The environment with every compiler command shadowed by one that logs and fails."""
    shims.mkdir()
    calls = shims / "calls.log"
    for name in COMPILERS:
        shim = shims / name
        shim.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit 1\n')
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
           "CC": str(shims / "cc"), "CXX": str(shims / "c++"), **extra}
    return env, calls


def run_install(checkout: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/install.sh"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=900)


def venv_lib_dir(checkout: Path) -> Path:
    found = sorted((checkout / ".venv").glob("lib/python3*/site-packages/llama_cpp/lib"))
    assert found, f"no llama_cpp/lib in {checkout / '.venv'}"
    return found[0]


def machine_wheel_dir() -> Path:
    out = subprocess.run(["bash", str(INSTALL), "--wheel-dir"], check=True, capture_output=True,
                         text=True).stdout.strip()
    return Path(out)


@pytest.mark.slow
@pytest.mark.network
def test_a_fresh_venv_installs_the_machine_wheel_and_compiles_nothing(tmp_path):
    # The wheel was built before this test (by the machine's own install.sh), so this venv is
    # already a later one; a second would read the same folder again and check nothing more.
    wheel_dir = machine_wheel_dir()
    if not list(wheel_dir.glob(f"llama_cpp_python-{LLAMA_CPP_VERSION}-*.whl")):
        pytest.skip(f"no wheel built on this machine yet in {wheel_dir}: run scripts/install.sh")
    before = sorted(p.name for p in wheel_dir.iterdir())
    env, calls = no_compiler_env(tmp_path / "shims")
    checkout = checkout_copy(tmp_path / "fresh")
    result = run_install(checkout, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"llama.cpp: {wheel_dir}" in result.stdout
    assert "building llama.cpp" not in result.stdout
    assert not calls.exists(), calls.read_text()
    libs = {p.name for p in venv_lib_dir(checkout).iterdir()}
    assert {"libllama.so", "libggml.so", "libggml-rpc.so", "libmtmd.so"} <= libs
    assert "libllama-common.so" not in libs
    assert "installed: localllm" in result.stdout
    assert sorted(p.name for p in wheel_dir.iterdir()) == before


def test_every_bound_c_function_is_exported():
    result = subprocess.run([sys.executable, "-m", "scripts.check_symbols"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 missing" in result.stdout


def test_symbol_check_names_what_a_build_without_rpc_misses(tmp_path):
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for lib in lib_dir.glob("*.so*"):
        if not lib.name.startswith("libggml-rpc"):
            shutil.copy2(lib, tmp_path / lib.name)
    result = subprocess.run([sys.executable, "-m", "scripts.check_symbols", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "localllm/engine/rpc.py: loads libggml-rpc.so" in result.stdout
    assert "localllm/engine/rpc.py: ggml_backend_rpc_start_server not exported" in result.stdout


def test_the_installed_engine_has_no_llama_common_and_each_library_once():
    import llama_cpp

    names = sorted(p.name for p in (Path(llama_cpp.__file__).parent / "lib").glob("*.so*"))
    assert "libllama-common.so" not in names, "built without scripts/llama_cmake_trim.cmake"
    assert all(name.endswith(".so") for name in names), names


def release_wheels() -> list[Path]:
    house = Path(os.environ.get("LOCALLLM_WHEELHOUSE", ROOT / "dist"))
    return sorted(house.glob(f"localllm_llama_cpp-{LLAMA_CPP_VERSION}-*.whl"))


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.skipif(not release_wheels(), reason="no release wheel: scripts/build_wheel.sh")
def test_release_wheel_installs_and_answers_without_a_compiler(tmp_path, smollm2_gguf):
    wheel = release_wheels()[-1]
    house = tmp_path / "wheelhouse"
    house.mkdir()
    shutil.copy2(wheel, house)
    env, calls = no_compiler_env(tmp_path / "shims", LOCALLLM_WHEELHOUSE=str(house))
    checkout = checkout_copy(tmp_path / "checkout")
    result = run_install(checkout, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "llama.cpp: release wheel" in result.stdout
    assert not calls.exists(), calls.read_text()
    python = str(checkout / ".venv" / "bin" / "python")
    checked = subprocess.run([python, "-m", "scripts.check_symbols"], cwd=checkout,
                             capture_output=True, text=True, timeout=120, env=env)
    assert checked.returncode == 0, checked.stdout

    daemon_env = isolated_env(tmp_path / "home", PATH=env["PATH"])
    import_models(daemon_env, {"smollm2": smollm2_gguf})
    serve = subprocess.Popen([python, "-m", "localllm.cli", "serve"], env=daemon_env,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        host = _listening_host(serve, deadline=time.monotonic() + 120)
        # The default model (smollm2) and a prompt: the README's first command.
        answer = subprocess.run([str(checkout / ".venv" / "bin" / "localllm"), "run", "hi"],
                                env={**daemon_env, "LOCALLLM_HOST": host},
                                capture_output=True, text=True, timeout=300)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=30)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip(), answer.stderr


def _listening_host(proc: subprocess.Popen, deadline: float) -> str:
    import json

    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"daemon exited with {proc.wait()} before listening")
        if line.startswith("{"):
            info = json.loads(line)
            if info.get("event") == "listening":
                return f"{info['host']}:{info['port']}"
    raise AssertionError("daemon did not listen in time")


def without(*commands: str) -> dict:
    """This environment with the PATH folders that hold any of `commands` left out, and no
    CUDA_HOME toolkit."""
    path = [p for p in os.environ["PATH"].split(os.pathsep)
            if not any((Path(p) / c).exists() for c in commands)]
    return {**os.environ, "PATH": os.pathsep.join(path), "CUDA_HOME": "/nonexistent"}


def gpu_shims(shims: Path, nvcc: bool) -> dict:
    """An NVIDIA driver's nvidia-smi (an RTX 3060) and, with `nvcc`, the CUDA toolkit's
    compiler, as commands on PATH (any real ones left out): what install.sh consults to choose
    the engine's build."""
    shims.mkdir()
    smi = shims / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 3060, 8.6'\n")
    smi.chmod(0o755)
    if nvcc:
        compiler = shims / "nvcc"
        compiler.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
        compiler.chmod(0o755)
    env = without("nvidia-smi", "nvcc")
    return {**env, "PATH": f"{shims}{os.pathsep}{env['PATH']}"}


def engine_choice(env: dict) -> list[str]:
    done = subprocess.run(["bash", str(INSTALL), "--engine"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_install_builds_with_cuda_where_the_driver_and_the_toolkit_are(tmp_path):
    env = gpu_shims(tmp_path / "bin", nvcc=True)
    lines = engine_choice(env)
    assert lines[0] == "CUDA for NVIDIA GeForce RTX 3060 (compute 86, release 12.4)", lines
    assert "-DGGML_CUDA=on" in lines[1] and "-DCMAKE_CUDA_ARCHITECTURES=86" in lines[1]
    cpu_dir = machine_wheel_dir()
    cuda_dir = subprocess.run(["bash", str(INSTALL), "--wheel-dir"], env=env, check=True,
                              capture_output=True, text=True).stdout.strip()
    assert Path(cuda_dir) != cpu_dir, "a CUDA build never shares the CPU build's wheel folder"
    cpu_only = engine_choice({**env, "LOCALLLM_CPU_ONLY": "1"})
    assert cpu_only[0] == "CPU" and "GGML_CUDA" not in cpu_only[1]


def test_install_with_a_driver_but_no_toolkit_says_what_to_install(tmp_path):
    lines = engine_choice(gpu_shims(tmp_path / "bin", nvcc=False))
    note = next(ln for ln in lines if ln.startswith("note:"))
    assert "RTX 3060" in note and "CUDA toolkit" in note and "nvidia-cuda-toolkit" in note
    assert lines[-2] == "CPU" and "GGML_CUDA" not in lines[-1]


def test_install_on_a_machine_without_nvidia_builds_for_the_cpu():
    lines = engine_choice(without("nvidia-smi"))
    assert lines[0] == "CPU" and len(lines) == 2, lines
    assert "GGML_CUDA" not in lines[1]
