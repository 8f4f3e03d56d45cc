#!/usr/bin/env bash
# Here, before a device run: the newest llama.cpp source this machine can reach, slimmed to what
# a CUDA build of llama-server and llama-bench needs, as .device-carry/llama-newest-src.tgz, for
# lab/device/build_newest_llama.sh on the GPU machine.
#
# Why this source: ggml-org/llama.cpp's git snapshot (1.47 GB) is over what the fetch tool brings
# (500 MB), and only the package registries are reachable. The newest llama.cpp on them is the
# tree vendored by the `xllamacpp` sdist (PyPI, XLLAMACPP_VERSION below): it has llama.cpp's own
# MoE expert cache (`--moe-cache-mib`), the newer `--fit`, and context checkpoints, which the
# llama.cpp inside llama-cpp-python 0.3.36 lacks.
#
#   bash lab/device/carry_newest_llama.sh [WORK_DIR]
#   bash lab/device/carry_newest_llama.sh --build [WORK_DIR]   # and build it here (nvcc, no GPU)
#
# --build compiles llama-server and llama-bench with CUDA for sm_90 here (about 25 minutes on
# two cores; lab/device/carry_patched_cuda.sh's head says what the toolkit needs) into
# .device-carry/newest-llama.tar.xz, its CPU code for any x86-64: build_newest_llama.sh there
# then builds only ggml-base and ggml-cpu, natively (lab/device/native_cpu.sh, from the ggml
# source packed with it), where the whole build took about seven minutes of device time.
set -euo pipefail
build=0; [ "${1:-}" = --build ] && { build=1; shift; }
XLLAMACPP_VERSION=2026.10.11549
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/newest-llama}
mkdir -p "$root/.device-carry" "$work"
sdist=$work/xllamacpp-$XLLAMACPP_VERSION.tar.gz
# the sdist from PyPI's simple index, its sha256 checked (`pip download` of an sdist builds its
# build requirements first, Cython from source: a quarter of an hour on two cores)
if [ ! -f "$sdist" ]; then
  link=$(curl -sfL https://pypi.org/simple/xllamacpp/ |
         grep -o "https://[^\"]*/xllamacpp-$XLLAMACPP_VERSION\.tar\.gz#sha256=[0-9a-f]*" | head -1)
  [ -n "$link" ] || { echo "error: PyPI lists no sdist of xllamacpp $XLLAMACPP_VERSION" >&2; exit 1; }
  curl -sfL -o "$sdist.part" "${link%%#*}"
  echo "${link##*=}  $sdist.part" | sha256sum -c --quiet - && mv "$sdist.part" "$sdist"
fi
rm -rf "$work/src" && mkdir -p "$work/src" && tar xzf "$sdist" -C "$work/src"
tree=$work/src/xllamacpp-$XLLAMACPP_VERSION/thirdparty
echo "xllamacpp-$XLLAMACPP_VERSION" > "$tree/llama.cpp/LOCALLLM_SOURCE"
# the CPU and CUDA backends, the libraries, the server and llama-bench: the rest (models, docs,
# the web UI's sources, other backends) is large and unused by that build
skip=(models docs media tests benches examples conversion gguf-py .github app pocs skills
      tools/ui/src tools/ui/tests tools/server/tests tools/mtmd/tests)
for b in cann metal hexagon sycl vulkan opencl openvino webgpu virtgpu et zdnn musa hip kompute; do
  skip+=("ggml/src/ggml-$b")
done
tar czf "$root/.device-carry/llama-newest-src.tgz" -C "$tree" \
  "${skip[@]/#/--exclude=llama.cpp/}" llama.cpp
du -h "$root/.device-carry/llama-newest-src.tgz"
[ "$build" = 1 ] || exit 0
# the build folder is kept: a stopped build goes on where it was (tar keeps the sources' times)
out=$work/out && rm -rf "$out/llama.cpp" && mkdir -p "$out" && tar xzf "$root/.device-carry/llama-newest-src.tgz" -C "$out"
bash "$root/lab/device/cuda_toolkit_here.sh" "$out/llama.cpp"  # cuBLAS and the driver stub
cmake -S "$out/llama.cpp" -B "$out/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DCMAKE_BUILD_TYPE=Release > "$out/cmake.log"
# the executables' link looks for libggml-cuda's libcuda.so.1 on the library path: the stub's
# folder, with a libcuda.so.1 link beside the stub
stubs=$(dirname "$(sed -n 's/^CUDA_cuda_driver_LIBRARY:FILEPATH=//p' "$out/build/CMakeCache.txt")")
LD_LIBRARY_PATH=$stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} \
  cmake --build "$out/build" -j "$(nproc)" --target llama-server llama-bench > "$out/build.log" ||
  { grep -m 10 -i error "$out/build.log" >&2; exit 1; }
bin=$out/build/bin
readelf -d "$bin/libggml-cuda.so" | grep -q 'libcuda.so.1' ||
  { echo "error: libggml-cuda.so does not link libcuda.so.1 (an empty stub?)" >&2; exit 1; }
cp "$out/llama.cpp/LOCALLLM_SOURCE" "$bin/SOURCE" && echo "built here with GGML_NATIVE=OFF" > "$bin/CPU_PORTABLE"
bash "$root/lab/device/ggml_slice.sh" "$out/llama.cpp" "$bin/ggml-src.tgz"  # for native_cpu.sh there
(cd "$bin" && tar cf - SOURCE CPU_PORTABLE ggml-src.tgz llama-server llama-bench lib*.so*) | xz -T0 -6 \
  > "$root/.device-carry/newest-llama.tar.xz"
du -h "$root/.device-carry/newest-llama.tar.xz"
