#!/usr/bin/env bash
# Here, before a device run: the patched llama.cpp source that lab/device/build_patched.sh
# builds on the GPU machine, as .device-carry/llama-src.tgz, made from a fresh llama-cpp-python
# sdist and this checkout's patches/ (scripts/apply_patches.sh). The tarball carries the
# patches' hash (llama.cpp/LOCALLLM_PATCHES); the device build refuses a tarball whose hash is
# not the checkout's, before compiling anything: a stale tarball once cost a lease.
#
#   bash ../shared/device/prepare.sh ...          # fills .device-carry/
#   bash lab/device/carry_patched_source.sh [WORK_DIR]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=${1:-/tmp/patched-source}
version=$(sed -n 's/^LLAMA_CPP_VERSION=\([0-9.]*\).*/\1/p' "$root/scripts/install.sh" | head -1)
[ -n "$version" ] || { echo "error: no LLAMA_CPP_VERSION in scripts/install.sh" >&2; exit 1; }
mkdir -p "$root/.device-carry" "$work"
sdist=$work/llama_cpp_python-$version.tar.gz
[ -f "$sdist" ] || python3 -m pip download -q --no-deps --no-binary=:all: -d "$work" \
  "llama-cpp-python==$version"
# the patched tree, $work/src/llama_cpp_python-VERSION, made again only when the patches
# change (lab/device/carry_patched_cuda.sh builds in it, incrementally while they do not)
vendor=$work/src/llama_cpp_python-$version/vendor
want=$(bash "$root/scripts/apply_patches.sh" --hash)
if [ "$(cat "$vendor/llama.cpp/LOCALLLM_PATCHES" 2>/dev/null)" != "$want" ]; then
  rm -rf "$work/src" && mkdir -p "$work/src" && tar xzf "$sdist" -C "$work/src"
  bash "$root/scripts/apply_patches.sh" "$work/src/llama_cpp_python-$version"
  echo "$want" > "$vendor/llama.cpp/LOCALLLM_PATCHES"
fi
# what a libllama build needs: the rest is large and unused there
tar czf "$root/.device-carry/llama-src.tgz" -C "$vendor" \
  --exclude='llama.cpp/'{models,docs,media,tests,benches,examples,conversion,gguf-py,.github,tools,app,pocs} \
  llama.cpp
# ggml's operator test, for lab/device/fattn_check.sh (the tarball leaves tests/ out)
xz -c "$vendor/llama.cpp/tests/test-backend-ops.cpp" > "$root/.device-carry/test-backend-ops.cpp.xz"
echo "wrote .device-carry/llama-src.tgz (patches $(cat "$vendor/llama.cpp/LOCALLLM_PATCHES"))"
