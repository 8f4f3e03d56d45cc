#!/usr/bin/env bash
# Here: the part of a llama.cpp source tree that lab/device/native_cpu.sh builds on the GPU
# machine (ggml with its CPU backend alone, and the tree's LOCALLLM_* stamps), as a tarball to
# pack beside a CUDA build made here: under a megabyte, where the whole source is six.
#   bash lab/device/ggml_slice.sh LLAMA_CPP_DIR OUT_TGZ
set -euo pipefail
tree=$(cd "${1:?llama.cpp dir}" && pwd); out=${2:?out tgz}
skip=()
for backend in "$tree"/ggml/src/ggml-*/; do
  name=$(basename "$backend")
  [ "$name" = ggml-cpu ] || skip+=("--exclude=llama.cpp/ggml/src/$name")
done
stamps=$(cd "$tree" && ls LOCALLLM_* 2>/dev/null | sed 's|^|llama.cpp/|' || true)
tar czf "$out" -C "$(dirname "$tree")" "${skip[@]}" llama.cpp/ggml $stamps
