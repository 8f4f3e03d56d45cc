#!/usr/bin/env bash
# On the GPU machine: build the engine with the project's patches (patches/, the expert cache of
# 0002 included) for CUDA, then decode greedy on a tiny synthetic MoE with the expert cache off
# and on (a pool of slots on the GPU, experts in RAM: moe_cache_check.py --gpu).
#   here:   tar the patched vendor/llama.cpp into .device-carry-cache/llama-src.tgz (see the
#           round's note), copy .device-carry/{llama_cpp,wheels} beside it
#   there:  bash lab/device/cache_check.sh .device-carry-cache $OUT
set -uo pipefail
carry=${1:?carry dir}; out=${2:?out dir}
mkdir -p "$out" /tmp/site /tmp/cuda-src
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$carry"/wheels/*.whl 2>/dev/null
cp -r "$carry/llama_cpp" /tmp/site/
tar xzf "$carry/llama-src.tgz" -C /tmp/cuda-src
cd /tmp/cuda-src/llama.cpp
start=$(date +%s)
cmake -B build -DGGML_CUDA=ON -DGGML_CUDA_FA=OFF -DCMAKE_CUDA_ARCHITECTURES=90-real \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release \
  > "$out/cmake.log" 2>&1 || { tail -30 "$out/cmake.log"; exit 1; }
cmake --build build -j "$(nproc)" --target llama > "$out/build.log" 2>&1 \
  || { grep -n "error" "$out/build.log" | head -40; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
cd - >/dev/null
export LLAMA_CPP_LIB_PATH=/tmp/cuda-src/llama.cpp/build/bin
export LD_LIBRARY_PATH=$LLAMA_CPP_LIB_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 - "$out" <<'PY'
import dataclasses, sys
from scripts import synth_gguf  # run from the checkout's root
tiny = synth_gguf.tiny(synth_gguf.SHAPES["qwen3-30b-a3b"])
shape = dataclasses.replace(tiny, name="moe-cache", n_layer=4, n_expert=32, n_expert_used=4)
for routing in ("zipf:1", "uniform"):
    synth_gguf.write_gguf(f"/tmp/moe-{routing[:4]}.gguf", shape, "Q4_0", "noise", routing=routing)
PY
for m in zipf unif; do
  run=(python3 -m scripts.moe_cache_check /tmp/moe-$m.gguf --gpu --prompt 40 --tokens 48 --verify 5)
  "${run[@]}" > "$out/$m-off.json" 2> "$out/$m-off.err"
  for slots in 0 16; do
    # the off run's tokens, forced: the logits compare step by step (moe_cache_check's head)
    "${run[@]}" --slots $slots --force "$out/$m-off.json" > "$out/$m-$slots.json" 2> "$out/$m-$slots.err"
    echo "$m $slots slots: rc=$? $(python3 -m scripts.moe_cache_check --compare "$out/$m-off.json" "$out/$m-$slots.json") $(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['stats'])" "$out/$m-$slots.json")"
  done
done
