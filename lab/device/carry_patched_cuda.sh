#!/usr/bin/env bash
# Here, before a device run: the whole patched engine built with CUDA for sm_90 on this machine
# (no GPU needed, only nvcc), packed as .device-carry/patched-engine.tar.xz, which
# tests/gpu/device_engine.sh unpacks on the GPU machine instead of building it there (four to
# five minutes of device time on 16 cores; here 18 minutes on two cores, incremental after).
# Its CPU code is built for any x86-64 (GGML_NATIVE=OFF: this machine's instructions may not run
# there), so the tarball says CPU_PORTABLE and holds ggml's source (ggml_slice.sh), from which
# device_engine.sh builds ggml-base and ggml-cpu again there, natively, in well under a minute.
#
#   bash ../shared/device/prepare.sh ...                 # fills .device-carry/
#   bash lab/device/carry_patched_cuda.sh [WORK_DIR]      # also writes llama-src.tgz
#
# Needs nvcc (CUDA 13, as the GPU machine has), cuBLAS headers and libraries, and libcuda for
# the link: lab/device/cuda_toolkit_here.sh adds what the toolkit lacks (cuBLAS from PyPI, a
# driver stub); the GPU machine's driver is the real one.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/patched-cuda}
# the patched source, fresh whenever the patches change, and the source tarball with it, so
# that both carried pieces come from the same patches
bash "$root/lab/device/carry_patched_source.sh" "$work"
src=$(echo "$work"/src/llama_cpp_python-*/vendor/llama.cpp)
want=$(cat "$src/LOCALLLM_PATCHES")
bash "$root/lab/device/cuda_toolkit_here.sh" "$src"  # cuBLAS and the driver stub, once
# tests/gpu/device_engine.sh's options, with portable CPU code
cmake -S "$src" -B "$work/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > "$work/cmake.log"
start=$(date +%s)
cmake --build "$work/build" -j "$(nproc)" --target llama > "$work/build.log" ||
  { grep -m 10 -i error "$work/build.log" >&2; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
bin=$work/build/bin
readelf -d "$bin/libggml-cuda.so" | grep -q 'libcuda.so.1' ||
  { echo "error: libggml-cuda.so does not link libcuda.so.1 (an empty stub?): see this script's head" >&2; exit 1; }
echo "$want" > "$bin/PATCHES" && echo "built here with GGML_NATIVE=OFF" > "$bin/CPU_PORTABLE"
bash "$root/lab/device/ggml_slice.sh" "$src" "$bin/ggml-src.tgz"  # for native_cpu.sh there
libs=$(cd "$bin" && ls lib*.so*)
tar cf - -C "$bin" PATCHES CPU_PORTABLE ggml-src.tgz $libs | xz -T0 -6 > "$root/.device-carry/patched-engine.tar.xz"
echo "carried: .device-carry/patched-engine.tar.xz ($(du -h "$root/.device-carry/patched-engine.tar.xz" | cut -f1), patches $want)"
