#!/usr/bin/env bash
# Here, before a device run: build ggml-cuda from the patched source (patches/0003 changes it)
# with this machine's nvcc, and put it into the carried CUDA build in place of the unpatched one,
# so that lab/device/build_patched.sh's quick path (patched libllama, ggml-base and
# ggml-cpu over the carried CUDA libraries) runs a wholly patched engine without building CUDA
# on the GPU machine (about four minutes of device time there; here about ten, on two cores).
#
#   bash ../shared/device/prepare.sh ...                 # fills .device-carry/
#   bash lab/device/carry_patched_cuda.sh [WORK_DIR]      # also writes llama-src.tgz
#
# Needs nvcc (CUDA 13, as the GPU machine has), cuBLAS headers and libraries, and libcuda for
# the link: where the toolkit lacks them, `pip download --no-deps "nvidia-cublas==13.0.*"`,
# unzip it and link its include/*.h and lib/*.so.13 into the toolkit (with unversioned
# libcublas.so and libcublasLt.so), and give the toolkit a stub lib/stubs/libcuda.so with
# soname libcuda.so.1 that defines the driver functions ggml-cuda calls (cuMemCreate, cuMemMap,
# ...: `int cuX(void){return 0;}` each; an empty stub is dropped by --as-needed and the library
# then fails to load there): the GPU machine's driver provides the real one.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/patched-cuda}
carry=$root/.device-carry/llama-cpp-0.3.36-cuda-sm90.tgz
[ -f "$carry" ] || { echo "error: no $carry: run ../shared/device/prepare.sh first" >&2; exit 1; }
# the patched source, fresh whenever the patches change, and the source tarball with it, so
# that both carried pieces come from the same patches
bash "$root/lab/device/carry_patched_source.sh" "$work"
src=$(echo "$work"/src/llama_cpp_python-*/vendor/llama.cpp)
# the carried build's options (../shared/device/build-cuda.sh), the ggml-cuda target alone
cmake -S "$src" -B "$work/build" -G Ninja -DGGML_CUDA=ON -DGGML_RPC=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > "$work/cmake.log"
ninja -C "$work/build" ggml-cuda > "$work/build.log"
lib=$(find "$work/build" -name 'libggml-cuda.so.*.*.*' | head -1)
readelf -d "$lib" | grep -q 'libcuda.so.1' ||
  { echo "error: $lib does not link libcuda.so.1 (an empty stub?): see this script's head" >&2; exit 1; }
name=$(basename "$lib")
tar tzf "$carry" | grep -qx "bin/$name" || { echo "error: the carry has no bin/$name" >&2; exit 1; }
unpack=$work/carry && rm -rf "$unpack" && mkdir -p "$unpack"
tar xzf "$carry" -C "$unpack"
cp "$lib" "$unpack/bin/$name"
chmod u+w "$carry"
tar czf "$carry" -C "$unpack" bin
echo "put the patched $name ($(du -h "$lib" | cut -f1)) into $(basename "$carry")"
