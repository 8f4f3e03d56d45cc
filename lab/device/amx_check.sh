#!/usr/bin/env bash
# On the GPU machine (issue #32): does its CPU have AMX, and which CPU builds of the vendored
# llama.cpp decode the default model's tensor table there (lab/device/check_cpu_engine.py, random
# weights): the carried CUDA build run on the CPU (native, AMX compiled in), and native CPU
# builds without and with patches/.
#   here:   tar czf .device-carry/llama-src-min.tgz -C <sdist>/vendor llama.cpp (models, tools,
#           GPU backends left out: about 5 MB); python3 -m lab.device.check_cpu_engine --skeleton
#           .device-carry/smollm2-skeleton.gguf
#   there:  source .device-carry/on-device.sh; bash lab/device/amx_check.sh $OUT
set -uo pipefail
out=${1:?results folder}
{ grep -o 'amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' '; grep -m1 'model name' /proc/cpuinfo
  gcc --version | head -1; command -v gcc; python3 --version; } > "$out/amx_flags.txt"
cat "$out/amx_flags.txt"
# The compiler here lives in /opt/gcc: its own libstdc++ goes with what it builds.
gcc_libs=$(dirname "$(gcc -print-file-name=libstdc++.so)")
check() {  # LIB NAME
  for flags in "" "--no-extra-bufts"; do
    CUDA_VISIBLE_DEVICES= LLAMA_CPP_LIB_PATH=$1 LD_LIBRARY_PATH=$1:$gcc_libs timeout 300 python3 \
      -m lab.device.check_cpu_engine --model /tmp/smollm2-skeleton.gguf \
      --header .device-carry/smollm2-skeleton.gguf $flags |
      python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['build']='$2'; print(json.dumps(d))" |
      tee -a "$out/amx_check.jsonl" | cut -c1-160
  done
}
check /tmp/llama-cuda/bin carried-cuda-build
for variant in native-unpatched native-patched; do
  src=/tmp/amx-$variant
  rm -rf "$src" && mkdir -p "$src" && tar xzf .device-carry/llama-src-min.tgz -C "$src"
  if [ "$variant" = native-patched ]; then
    patch -d "$src/llama.cpp" -p3 --batch < patches/0001-no-amx.patch || exit 1
  fi
  (cd "$src/llama.cpp" && cmake -B build -DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF \
     -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_COMMON=OFF \
     -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release >"$out/cmake-$variant.log" 2>&1 &&
   cmake --build build -j "$(nproc)" --target llama >"$out/build-$variant.log" 2>&1) ||
    { tail -20 "$out/build-$variant.log"; continue; }
  check "$src/llama.cpp/build/bin" "$variant"
done
ldd /tmp/amx-native-patched/llama.cpp/build/bin/libllama.so | grep -i "stdc\|ggml" > "$out/ldd.txt"
cat "$out/ldd.txt"
