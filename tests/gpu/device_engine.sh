#!/usr/bin/env bash
# On the GPU machine, after `source .device-carry/on-device.sh`: the engine with this checkout's
# patches (patches/), built with CUDA for sm_90, in /tmp/patched/bin; prints the variables that
# make llama_cpp and the daemon's runners use it.
#
#   eval "$(bash tests/gpu/device_engine.sh)"
#
# A build of the same patches carried from an earlier call, or built without a GPU by
# lab/device/carry_patched_cuda.sh (its CPU side then rebuilt here natively, well under a
# minute), is unpacked from .device-carry/patched-engine.tar.xz (its patches' hash inside); else
# the patched source carried as .device-carry/llama-src.tgz (lab/device/carry_patched_source.sh)
# is built, about four minutes on 16 cores, and its libraries are packed into $OUT in pieces of
# 15 MiB (cat $OUT/engine.part-* > .device-carry/patched-engine.tar.xz here, for the next call).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.device-carry
dest=/tmp/patched/bin
prebuilt=/tmp/llama-cuda/bin   # on-device.sh's unpatched CUDA build: RPC, mtmd, the tools
want=$(bash "$root/scripts/apply_patches.sh" --hash)
log=/tmp/patched/build.log
mkdir -p "$dest"
cp -a "$prebuilt"/lib*.so* "$dest/"
if [ -f "$carry/patched-engine.tar.xz" ] &&
   [ "$(tar xJf "$carry/patched-engine.tar.xz" -O PATCHES 2>/dev/null)" = "$want" ]; then
    tar xJf "$carry/patched-engine.tar.xz" -C "$dest" --exclude PATCHES
    if [ -f "$dest/CPU_PORTABLE" ]; then  # built without a GPU (lab/device/carry_patched_cuda.sh)
        [ "$(tar xzf "$dest/ggml-src.tgz" -O llama.cpp/LOCALLLM_PATCHES)" = "$want" ] ||
            { echo "error: the carried ggml source is not of patches $want" >&2; exit 1; }
        bash "$root/lab/device/native_cpu.sh" "$dest/ggml-src.tgz" "$dest"
        echo "patched engine $want: unpacked the carried CUDA build, its CPU side built here" >&2
    else
        echo "patched engine $want: unpacked the carried build" >&2
    fi
else
    work=/tmp/patched/src
    rm -rf "$work" && mkdir -p "$work" && tar xzf "$carry/llama-src.tgz" -C "$work"
    have=$(cat "$work/llama.cpp/LOCALLLM_PATCHES" 2>/dev/null || echo none)
    [ "$have" = "$want" ] || { echo "error: llama-src.tgz has patches $have, the checkout $want: run lab/device/carry_patched_source.sh" >&2; exit 1; }
    start=$(date +%s)
    cmake -S "$work/llama.cpp" -B "$work/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > "$log" 2>&1
    cmake --build "$work/build" -j "$(nproc)" --target llama >> "$log" 2>&1 ||
        { grep -m 10 -i 'error' "$log" >&2; exit 1; }
    libs=$(cd "$work/build/bin" && ls lib*.so*)
    (cd "$work/build/bin" && cp -a $libs "$dest/")
    echo "$want" > "$work/build/bin/PATCHES"
    if [ -n "${OUT:-}" ]; then
        tar cf - -C "$work/build/bin" PATCHES $libs | xz -T0 -3 | split -b 15M - "$OUT/engine.part-"
    fi
    echo "patched engine $want: built with CUDA in $(( $(date +%s) - start )) s" >&2
fi
echo "export LLAMA_CPP_LIB_PATH=$dest LD_LIBRARY_PATH=$dest:${LD_LIBRARY_PATH:-}"
