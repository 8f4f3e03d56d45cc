#!/usr/bin/env bash
# On the GPU machine: the patched engine (patches/) in DIR (default /tmp/cuda-src/llama.cpp/build/bin),
# for LLAMA_CPP_LIB_PATH, in about a minute instead of three or four.
#
#   bash lab/device/carry_patched_source.sh             # here: .device-carry/llama-src.tgz
#   source .device-carry/on-device.sh                # there, from the checkout's root
#   bash lab/device/build_patched.sh .device-carry/llama-src.tgz [DIR]
#
# libllama, ggml-base and ggml-cpu are built from the patched source without CUDA, and the CUDA
# build that on-device.sh unpacked (/tmp/llama-cuda/bin) lends the rest: libggml (the backend
# registry, linked to the CUDA and RPC backends) and libggml-cuda, built from the same llama.cpp
# release, so every ggml struct they share has the same layout. patches/0003 changes ggml-cuda
# too: lab/device/carry_patched_cuda.sh puts a patched libggml-cuda into the carry before the run.
# The result must offload to the GPU, export the expert cache's function and have 0003's mapped
# buffers in ggml-cuda; when it does not, the whole engine is built with CUDA instead (the slow
# way), so a run never measures a half-patched engine.
set -euo pipefail
src=${1:?source tgz}; dest=${2:-/tmp/cuda-src/llama.cpp/build/bin}
prebuilt=${PREBUILT:-/tmp/llama-cuda/bin}
work=/tmp/patched-src
start=$(date +%s)
rm -rf "$work" && mkdir -p "$work" && tar xzf "$src" -C "$work"
# a tarball made from other patches than this checkout's measures the wrong engine: stop here
want=$(bash scripts/apply_patches.sh --hash)
have=$(cat "$work/llama.cpp/LOCALLLM_PATCHES" 2>/dev/null || echo none)
if [ "$have" != "$want" ]; then
    echo "error: $src was made from patches $have, this checkout has $want: run lab/device/carry_patched_source.sh" >&2
    exit 1
fi
cd "$work/llama.cpp"
# the carried tree leaves out app/, tools/, examples/ and tests/: their options must be off
common=(-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
        -DCMAKE_BUILD_TYPE=Release)

check() {  # the engine in $1 offloads to the GPU and has the expert cache
    LLAMA_CPP_LIB_PATH=$1 LD_LIBRARY_PATH=$1:${LD_LIBRARY_PATH:-} python3 -c '
import ctypes, os, llama_cpp
lib = ctypes.CDLL(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], "libllama.so"))
assert llama_cpp.llama_supports_gpu_offload(), "no GPU offload"
assert hasattr(lib, "llama_moe_cache_stats"), "no expert cache"
assert hasattr(lib, "llama_moe_cache_set_params"), "no expert cache settings (patches/0006)"
base = ctypes.CDLL(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], "libggml-base.so"))
cuda = ctypes.CDLL(os.path.join(os.environ["LLAMA_CPP_LIB_PATH"], "libggml-cuda.so"))
cuda.ggml_backend_cuda_reg.restype = ctypes.c_void_p
base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
assert base.ggml_backend_reg_get_proc_address(
    cuda.ggml_backend_cuda_reg(), b"ggml_backend_cuda_mapped_buffer"), "ggml-cuda without 0003"
print("patched engine: GPU offload, expert cache, mapped misses")'
}

if cmake -B build-cpu -DGGML_CUDA=OFF "${common[@]}" > "$work/cmake-cpu.log" 2>&1 &&
   cmake --build build-cpu -j "$(nproc)" --target llama > "$work/build-cpu.log" 2>&1; then
    mkdir -p "$dest"
    # the prebuilt CUDA side first, then the patched libraries over it
    find "$prebuilt" -maxdepth 1 -name 'lib*.so*' ! -name 'libllama.so*' \
        ! -name 'libggml-base.so*' ! -name 'libggml-cpu.so*' -exec cp -a {} "$dest/" \;
    for lib in libllama libggml-base libggml-cpu; do
        find build-cpu -name "$lib.so*" -exec cp -a {} "$dest/" \;
    done
    if check "$dest"; then
        echo "built the patched libraries in $(( $(date +%s) - start )) s (the CUDA libraries: the carried ones)"
        exit 0
    fi
    echo "the quick build did not load as a patched GPU engine: building it all with CUDA" >&2
else
    grep -h -m 5 'error' "$work/cmake-cpu.log" "$work/build-cpu.log" >&2 || true
    echo "the quick build failed: building it all with CUDA" >&2
fi
cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real "${common[@]}" \
    > "$work/cmake.log" 2>&1
cmake --build build -j "$(nproc)" --target llama > "$work/build.log" 2>&1 ||
    { grep -m 5 'error' "$work/build.log" >&2; exit 1; }
rm -rf "$dest" && mkdir -p "$dest" && find build -name '*.so*' -exec cp -a {} "$dest/" \;
check "$dest"
echo "built the whole patched engine with CUDA in $(( $(date +%s) - start )) s"
