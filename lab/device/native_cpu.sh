#!/usr/bin/env bash
# On the GPU machine: ggml-base and ggml-cpu built for this machine's processor (GGML_NATIVE, as
# a build here would be) into DEST, over a CUDA build of the same source made without a GPU for
# any x86-64 (DEST/CPU_PORTABLE; lab/device/carry_patched_cuda.sh, carry_newest_llama.sh
# --build). Experts computed on the CPU are half of what the MoE benchmarks measure, so their
# code must be the machine's own. SOURCE_TGZ holds llama.cpp/ggml (the build carries that slice,
# without ggml-cuda, as DEST/ggml-src.tgz); ggml is built on its own, with the options llama.cpp
# gives it (llamafile sgemm). Well under a minute.
#   bash lab/device/native_cpu.sh SOURCE_TGZ DEST
set -euo pipefail
src=${1:?source tgz}; dest=${2:?dest folder}
work=$(mktemp -d /tmp/native-cpu.XXXXXX)
start=$(date +%s)
tar xzf "$src" -C "$work" llama.cpp/ggml
# ggml on its own wants its pkg-config template, which the packaged sources leave out
[ -f "$work/llama.cpp/ggml/ggml.pc.in" ] || : > "$work/llama.cpp/ggml/ggml.pc.in"
cmake -S "$work/llama.cpp/ggml" -B "$work/build" -DGGML_CUDA=OFF -DGGML_BUILD_TESTS=OFF \
    -DGGML_BUILD_EXAMPLES=OFF -DGGML_LLAMAFILE=ON -DCMAKE_BUILD_TYPE=Release > "$work/build.log" 2>&1 ||
    { tail -5 "$work/build.log" >&2; exit 1; }
cmake --build "$work/build" -j "$(nproc)" --target ggml-cpu >> "$work/build.log" 2>&1 ||
    { grep -m 10 -i 'error' "$work/build.log" >&2; exit 1; }
find "$work/build" \( -name 'libggml-base.so*' -o -name 'libggml-cpu.so*' \) -exec cp -a {} "$dest/" \;
[ -e "$dest/libggml-cpu.so" ] || { echo "error: no libggml-cpu.so from the build ($work)" >&2; exit 1; }
rm -f "$dest/CPU_PORTABLE"
rm -rf "$work"
echo "ggml-cpu built natively in $(( $(date +%s) - start )) s" >&2
