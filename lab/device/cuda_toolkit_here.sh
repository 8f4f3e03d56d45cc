#!/usr/bin/env bash
# Here, before lab/device/carry_patched_cuda.sh or carry_newest_llama.sh --build: completes this
# machine's CUDA toolkit (nvcc only, no GPU) with what linking ggml-cuda needs, once per machine:
# cuBLAS from PyPI's nvidia-cublas wheel (headers, libraries and their unversioned names), and a
# stub libcuda.so.1 that defines every driver function ggml-cuda calls. An empty stub is dropped
# by --as-needed and the library then fails to load on the GPU machine, whose driver is the
# real one; so each function the source names gets a `return 0` body here.
#
#   bash lab/device/cuda_toolkit_here.sh LLAMA_CPP_SOURCE_DIR
set -euo pipefail
src=${1:?usage: cuda_toolkit_here.sh LLAMA_CPP_SOURCE_DIR}
cuda=$(readlink -f "${CUDA_HOME:-/usr/local/cuda}")
[ -x "$cuda/bin/nvcc" ] || { echo "error: no nvcc under $cuda" >&2; exit 1; }
lib=$cuda/lib64
if [ ! -e "$lib/libcublas.so" ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" 'nvidia-cublas>=13,<14'
  (cd "$tmp" && unzip -q nvidia_cublas-*.whl 'nvidia/*')
  cp "$tmp"/nvidia/cu13/include/*.h "$cuda/include/"
  cp "$tmp"/nvidia/cu13/lib/libcublas*.so.13 "$lib/"
  ln -sf libcublas.so.13 "$lib/libcublas.so" && ln -sf libcublasLt.so.13 "$lib/libcublasLt.so"
  rm -rf "$tmp"
  echo "cuBLAS: $(ls "$lib"/libcublas.so.13)"
fi
# the stub grows with each source it is run for (the newest llama.cpp calls more of the driver)
mkdir -p "$lib/stubs"
names=$(mktemp)
{ grep -rohE '\bcu[A-Z][A-Za-z0-9_]*' "$src"/ggml/src/ggml-cuda/ |
    grep -vE '^cu(blas|da|rand|fft|sparse|solver|Complex)'  # runtime and library names
  sed -n 's/^int \(cu[A-Za-z0-9_]*\)(void).*/\1/p' "$lib/stubs/libcuda.c" 2>/dev/null || true
} | sed 's/_v[0-9]*$//' | sort -u > "$names"
# each name with the versioned suffixes cuda.h maps it to (cuMemGetInfo -> cuMemGetInfo_v2)
sed 's/.*/int &(void){return 0;}\nint &_v2(void){return 0;}\nint &_v3(void){return 0;}/' "$names" \
  > "$names.c"
if ! cmp -s "$names.c" "$lib/stubs/libcuda.c"; then
  mv "$names.c" "$lib/stubs/libcuda.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib/stubs/libcuda.so" "$lib/stubs/libcuda.c"
  ln -sf libcuda.so "$lib/stubs/libcuda.so.1"
  echo "stub libcuda.so: $(wc -l < "$names") driver functions"
fi
rm -f "$names" "$names.c"
