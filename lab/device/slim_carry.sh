#!/usr/bin/env bash
# Here, once the patched engine is carried (.device-carry/patched-engine.tar.xz): the carried
# prebuilt llama.cpp (on-device.sh's tarball) without its libggml-cuda, 70 of its 92 MB. On the
# GPU machine tests/gpu/device_engine.sh copies the prebuilt's libraries and then the patched
# engine's over them, so that one is never used; without it the carry holds both CUDA builds
# (ours and the newest llama.cpp) within the 64 MiB a device call takes. The prebuilt
# llama-bench and llama-server then run on the patched ggml (the baseline is the newest
# llama.cpp, which brings its own).
#   bash lab/device/slim_carry.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
carry=$root/.device-carry
tgz=$carry/llama-cpp-0.3.36-cuda-sm90.tgz
[ -f "$carry/patched-engine.tar.xz" ] ||
  { echo "error: no patched engine carried (lab/device/carry_patched_cuda.sh first)" >&2; exit 1; }
listing=$(tar tzf "$tgz")  # whole: grep -q's early exit would fail the pipe
grep -q 'libggml-cuda' <<< "$listing" || { echo "already slim: $(du -h "$tgz" | cut -f1)"; exit 0; }
work=$(mktemp -d) && trap 'rm -rf "$work"' EXIT
tar xzf "$tgz" -C "$work" && rm -f "$work"/bin/libggml-cuda.so*
chmod u+w "$tgz" && tar czf "$tgz" -C "$work" . && chmod a-w "$tgz"
du -h "$tgz"
