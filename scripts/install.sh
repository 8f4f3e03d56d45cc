#!/usr/bin/env bash
# Install localllm into ./.venv (CPU build of llama.cpp; see README for CUDA).
# llama.cpp is built with the project's patches (patches/, e.g. no AMX kernels: they crash).
#   scripts/install.sh            the program
#   scripts/install.sh --test     the program plus what the test suite needs
#   scripts/install.sh --wheel-dir   print the wheel folder of this machine's build, and exit
# The engine, llama-cpp-python 0.3.36, comes from the first of:
#   1. a release wheel localllm_llama_cpp-0.3.36-*.whl in $LOCALLLM_WHEELHOUSE or dist/
#      (scripts/build_wheel.sh makes one);
#   2. this machine's wheel folder, ${XDG_CACHE_HOME:-~/.cache}/localllm/wheels/<key>/, the key
#      naming all that shapes the binary (version, CMAKE_ARGS with the trim file's hash,
#      Python tag, CPU);
#   3. a source build into that folder: once per machine and flags, so the next venv compiles
#      nothing. The compile log goes to the folder's build.log.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1
LLAMA_CPP_VERSION=0.3.36
# The cold build: 414 CPU seconds measured on 2 cores, so about 4 minutes when both are free
# (README, "Install").
BUILD_TIME="about 4 minutes on 2 free cores, longer while they are busy"

# GGML_RPC adds llama.cpp's RPC backend (libggml-rpc): `localllm worker` and `rpc_workers`;
# the trim file leaves out llama-common, which nothing here loads.
trim="$PWD/scripts/llama_cmake_trim.cmake"
cmake_args="${CMAKE_ARGS:-} -DGGML_RPC=on -DCMAKE_PROJECT_llama.cpp_INCLUDE=$trim"
# The GPU this machine has: a CUDA build where NVIDIA's driver (nvidia-smi) and the CUDA toolkit
# (nvcc) are both here, for the card's compute capability alone; a driver without the toolkit
# gets a CPU build and a line on what to install. LOCALLLM_CPU_ONLY=1 builds for the CPU
# whatever is found; CMAKE_ARGS naming GGML_CUDA is taken as it is.
engine="CPU"
gpu="$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -n 1 || true)"
if [ -z "${LOCALLLM_CPU_ONLY:-}" ] && [[ "$cmake_args" != *GGML_CUDA* ]] && [ -n "$gpu" ]; then
  gpu_name="${gpu%%,*}"
  cap="${gpu##*, }"
  cap="${cap//./}"
  nvcc="$(command -v nvcc || true)"
  cuda_home="${CUDA_HOME:-/usr/local/cuda}"
  [ -z "$nvcc" ] && [ -x "$cuda_home/bin/nvcc" ] && nvcc="$cuda_home/bin/nvcc"
  if [ -n "$nvcc" ]; then
    cmake_args="$cmake_args -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=$cap -DCMAKE_CUDA_COMPILER=$nvcc"
    engine="CUDA for $gpu_name (compute $cap, $("$nvcc" --version | grep -o 'release [0-9.]*' | tr -d ,))"
    BUILD_TIME="a CUDA build takes 10-30 minutes, by the cores"
  else
    echo "note: found $gpu_name but no CUDA toolkit (nvcc): building llama.cpp for the CPU." \
         "For the GPU, install the toolkit (Debian: apt install nvidia-cuda-toolkit, or NVIDIA's" \
         "cuda-toolkit) and run scripts/install.sh again."
  fi
fi
[ "${1:-}" = "--engine" ] && { echo "$engine"; echo "CMAKE_ARGS=${cmake_args# }"; exit 0; }
# The project's changes to the vendored llama.cpp (patches/, applied before the compile).
patches_hash="$(bash scripts/apply_patches.sh --hash)"
key="$(python3 - "$LLAMA_CPP_VERSION" "$cmake_args" "$trim" "$patches_hash" <<'EOF'
import hashlib, platform, sys
version, cmake_args, trim, patches_hash = sys.argv[1:]
trim_hash = hashlib.sha256(open(trim, "rb").read()).hexdigest()[:16]
# GGML_NATIVE (on unless CMAKE_ARGS says off) compiles for this CPU: a home folder shared by
# machines with other CPUs must not hand them this wheel.
cpu = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
shaped_by = "\n".join([version, " ".join(cmake_args.replace(trim, "trim:" + trim_hash).split()),
                       "patches:" + patches_hash,
                       platform.machine(), hashlib.sha256(cpu.encode()).hexdigest()])
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
print(f"llama-cpp-python-{version}-{tag}-{platform.machine()}-"
      f"{hashlib.sha256(shaped_by.encode()).hexdigest()[:12]}")
EOF
)"
wheels="${XDG_CACHE_HOME:-$HOME/.cache}/localllm/wheels"
wheel_dir="$wheels/$key"
[ "${1:-}" = "--wheel-dir" ] && { echo "$wheel_dir"; exit 0; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
need_apt=()
python3 -c 'import ensurepip, venv' 2>/dev/null || need_apt+=(python3-venv)
if [ "$want_test" = 1 ]; then
  command -v systemd-analyze >/dev/null || need_apt+=(systemd)
  command -v tmux >/dev/null || need_apt+=(tmux)
  # The agent CLIs' end-to-end tests install Claude Code, Codex... from npm (tests/test_agent_clis.py).
  command -v npm >/dev/null || need_apt+=(nodejs npm)
fi

wheelhouse="${LOCALLLM_WHEELHOUSE:-dist}"
release_wheel=""
arch="$(uname -m)"
for whl in "$wheelhouse"/localllm_llama_cpp-"$LLAMA_CPP_VERSION"-*"$arch".whl; do
  [ -f "$whl" ] && release_wheel="$whl"
done
# The release wheel runs on the CPU alone: a machine that can build for its GPU does.
[ "$engine" != CPU ] && release_wheel=""
[ -z "$release_wheel" ] && ! command -v g++ >/dev/null && need_apt+=(build-essential)

if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing system packages: ${need_apt[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip)
"${pip[@]}" install -q --upgrade pip
extra=""
[ "$want_test" = 1 ] && extra="[test]"

if [ -n "$release_wheel" ]; then
  echo "llama.cpp: release wheel $release_wheel"
  # Both distributions own llama_cpp/: never leave the other one installed beside it.
  "${pip[@]}" uninstall -q -y llama-cpp-python 2>/dev/null || true
  # Its dependencies (numpy, ...) come from the index; the engine only from the wheelhouse.
  "${pip[@]}" install -q --force-reinstall --find-links "$wheelhouse" \
    "localllm-llama-cpp==$LLAMA_CPP_VERSION"
  # That wheel holds llama-cpp-python's `llama_cpp` under the project's own name, so pip must
  # not resolve localllm's llama-cpp-python requirement (that would compile the source): the
  # other requirements come from pyproject.toml, and localllm itself goes in without them.
  .venv/bin/python - "$want_test" >.venv/localllm-requirements.txt <<'EOF'
import re, sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = project["dependencies"]
if sys.argv[1] == "1":
    deps += project["optional-dependencies"]["test"]
print("\n".join(d for d in deps if re.split(r"[<>=!~ ;\[]", d)[0] != "llama-cpp-python"))
EOF
  echo "installing localllm$extra..."
  "${pip[@]}" install -q -r .venv/localllm-requirements.txt
  PYTHONWARNINGS=ignore::UserWarning "${pip[@]}" install -q --no-deps -e .
else
  if ! ls "$wheel_dir"/llama_cpp_python-"$LLAMA_CPP_VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama.cpp once for this machine: llama-cpp-python $LLAMA_CPP_VERSION with"
    echo "  libllama, ggml ($engine, RPC), mtmd; CMAKE_ARGS=${cmake_args# }"
    echo "  $BUILD_TIME; later venvs reuse the wheel in"
    echo "  $wheel_dir"
    mkdir -p "$wheels"
    build="$(mktemp -d "$wheels/.build-XXXXXX")"
    started=$SECONDS
    # pip's own wheel cache is keyed on the download URL, not on CMAKE_ARGS: it would hand back
    # a wheel built with other flags, so the build skips it.
    src="$build/llama_cpp_python-$LLAMA_CPP_VERSION"
    if ! { "${pip[@]}" download -q --no-deps --no-binary llama-cpp-python -d "$build" \
             "llama-cpp-python==$LLAMA_CPP_VERSION" &&
           tar -xzf "$src.tar.gz" -C "$build" &&
           bash scripts/apply_patches.sh "$src" &&
           CMAKE_ARGS="$cmake_args" "${pip[@]}" wheel --no-cache-dir --no-deps -w "$build" \
             "$src"; } >"$build/build.log" 2>&1; then
      tail -n 40 "$build/build.log"
      echo "error: building llama-cpp-python failed; the whole log is $build/build.log" >&2
      exit 1
    fi
    rm -rf "$src" "$src.tar.gz"
    printf '%s\n' "$cmake_args" >"$build/cmake_args"
    # A folder appears whole or not at all: a build stopped half-way is never taken.
    mv -T "$build" "$wheel_dir" 2>/dev/null || rm -rf "$build"
    echo "  built in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"
  fi
  echo "llama.cpp: $wheel_dir"
  "${pip[@]}" uninstall -q -y localllm-llama-cpp 2>/dev/null || true
  "${pip[@]}" install -q --force-reinstall --no-deps --no-index --find-links "$wheel_dir" \
    "llama-cpp-python==$LLAMA_CPP_VERSION"
  echo "installing localllm$extra..."
  PYTHONWARNINGS=ignore::UserWarning "${pip[@]}" install -q -e ".$extra"
fi
# What the engine was compiled for, as it reports itself (the CPU line of its system info).
echo "llama.cpp built for: $(.venv/bin/python -m localllm.engine.cpu --built-for)"
echo "installed: $(.venv/bin/localllm --version)  ->  .venv/bin/localllm"
