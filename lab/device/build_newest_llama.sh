#!/usr/bin/env bash
# On the GPU machine: llama-server and llama-bench of the newest llama.cpp
# (lab/device/carry_newest_llama.sh), built with CUDA for sm_90 into /tmp/newest/bin; prints
# the folder. A build carried back from an earlier call (.device-carry/newest-llama.tar.xz) is
# unpacked in seconds; otherwise the carried source is built (all cores) and the binaries and
# libraries are packed into $OUT/newest.part-* (cat them into .device-carry/newest-llama.tar.xz
# here for the next call); a build an earlier call left on the same (still warm) machine is
# used as it is.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.device-carry
dest=/tmp/newest/bin
mkdir -p "$dest"
if [ -x "$dest/llama-server" ] && [ -f "$dest/SOURCE" ]; then
  echo "newest llama.cpp: built by an earlier call on this machine ($(cat "$dest/SOURCE"))" >&2
elif [ -f "$carry/newest-llama.tar.xz" ]; then
  tar xJf "$carry/newest-llama.tar.xz" -C "$dest"
  # built without a GPU (carry_newest_llama.sh --build): its CPU code made for this machine here
  [ ! -f "$dest/CPU_PORTABLE" ] || bash "$root/lab/device/native_cpu.sh" "$dest/ggml-src.tgz" "$dest"
  echo "newest llama.cpp: unpacked the carried build ($(cat "$dest/SOURCE"))" >&2
else
  work=/tmp/newest/src
  rm -rf "$work" && mkdir -p "$work" && tar xzf "$carry/llama-newest-src.tgz" -C "$work"
  start=$(date +%s)
  log=/tmp/newest/build.log
  cmake -S "$work/llama.cpp" -B "$work/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90-real \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_APP=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release > "$log" 2>&1 ||
      { tail -30 "$log" >&2; exit 1; }
  cmake --build "$work/build" -j "$(nproc)" --target llama-server llama-bench >> "$log" 2>&1 ||
      { grep -m 20 -i -B2 -A3 'error' "$log" >&2; exit 1; }
  cp -a "$work/build/bin/llama-server" "$work/build/bin/llama-bench" "$work/build/bin/"lib*.so* "$dest/"
  cp "$work/llama.cpp/LOCALLLM_SOURCE" "$dest/SOURCE"
  if [ -n "${OUT:-}" ]; then
    (cd "$dest" && tar cf - SOURCE llama-server llama-bench lib*.so*) | xz -T0 -3 |
      split -b 15M - "$OUT/newest.part-"
  fi
  echo "newest llama.cpp $(cat "$dest/SOURCE"): built with CUDA in $(( $(date +%s) - start )) s" >&2
fi
echo "$dest"
