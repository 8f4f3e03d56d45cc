#!/usr/bin/env bash
# Install localllm into ./.venv (CPU build of llama.cpp; see README for CUDA).
#   scripts/install.sh            the program
#   scripts/install.sh --test     the program plus what the test suite needs
# llama-cpp-python only ships as source: the first install compiles llama.cpp (5-8 minutes on
# 2 cores). Later runs reuse the built wheel from pip's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo "$@"; else return 1; fi; }
need_apt=()
python3 -c 'import ensurepip, venv' 2>/dev/null || need_apt+=(python3-venv)
command -v g++ >/dev/null || need_apt+=(build-essential)
if [ "$want_test" = 1 ]; then
  command -v systemd-analyze >/dev/null || need_apt+=(systemd)
  command -v tmux >/dev/null || need_apt+=(tmux)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing system packages: ${need_apt[*]}"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
extra=""
[ "$want_test" = 1 ] && extra="[test]"
echo "installing localllm$extra (the first time compiles llama.cpp: several minutes)..."
# GGML_RPC adds llama.cpp's RPC backend (libggml-rpc): `localllm worker` and `rpc_workers`.
export CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_RPC=on"
.venv/bin/python -m pip install -q -e ".$extra"
# A wheel cached from a build without RPC would be reused silently: rebuild it once.
if ! ls .venv/lib/python3*/site-packages/llama_cpp/lib/libggml-rpc.so >/dev/null 2>&1; then
  echo "rebuilding llama-cpp-python with the RPC backend..."
  .venv/bin/python -m pip install -q --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36
fi
echo "installed: $(.venv/bin/localllm --version)  ->  .venv/bin/localllm"
