#!/usr/bin/env bash
# On the GPU machine: ggml-base and ggml-cpu built for this machine's processor (GGML_NATIVE, as
# a build here would be) from a carried llama.cpp source, into DEST, over a CUDA build of the
# same source made without a GPU for any x86-64 (DEST/CPU_PORTABLE; lab/device/
# carry_patched_cuda.sh, carry_newest_llama.sh --build). Experts computed on the CPU are half of
# what the MoE benchmarks measure, so their code must be the machine's own. Well under a minute.
#   bash lab/device/native_cpu.sh SOURCE_TGZ DEST
set -euo pipefail
src=${1:?source tgz}; dest=${2:?dest folder}
work=$(mktemp -d /tmp/native-cpu.XXXXXX)
start=$(date +%s)
tar xzf "$src" -C "$work"
cmake -S "$work/llama.cpp" -B "$work/build" -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > "$work/build.log" 2>&1
cmake --build "$work/build" -j "$(nproc)" --target ggml-cpu >> "$work/build.log" 2>&1 ||
    { grep -m 10 -i 'error' "$work/build.log" >&2; exit 1; }
(cd "$work/build/bin" && cp -a libggml-base.so* libggml-cpu.so* "$dest/")
rm -f "$dest/CPU_PORTABLE"
rm -rf "$work"
echo "ggml-cpu built natively from $(basename "$src") in $(( $(date +%s) - start )) s" >&2
