#!/usr/bin/env bash
# Apply the project's changes to the vendored llama.cpp (patches/*.patch, in name order) to an
# unpacked llama-cpp-python source tree. Every patch must apply whole: one that no longer does
# (a new llama-cpp-python, an edited patch) stops the build here, named, before any compile.
#   scripts/apply_patches.sh SRC_DIR     patch SRC_DIR in place
#   scripts/apply_patches.sh --hash      print the hash of the patches (for wheel folder keys)
set -euo pipefail
patches_dir="$(cd "$(dirname "$0")/../patches" && pwd)"
if [ "${1:-}" = "--hash" ]; then
  cat "$patches_dir"/*.patch | sha256sum | cut -c1-16
  exit 0
fi
src="${1:?usage: apply_patches.sh SRC_DIR}"
for p in "$patches_dir"/*.patch; do
  if command -v patch >/dev/null; then
    check=(patch -d "$src" -p1 --forward --batch --dry-run --quiet)
    apply=(patch -d "$src" -p1 --forward --batch --quiet)
  else
    check=(git -C "$src" apply -p1 --check)
    apply=(git -C "$src" apply -p1)
  fi
  if ! "${check[@]}" <"$p" >/dev/null 2>&1; then
    echo "error: $(basename "$p") no longer applies to $src; update it for this llama.cpp" >&2
    "${check[@]}" <"$p" >&2 || true
    exit 1
  fi
  "${apply[@]}" <"$p"
  echo "  patched: $(basename "$p")"
done
