#!/usr/bin/env bash
# On the GPU machine, with the patched engine built (lab/device/build_patched.sh): greedy
# decode of a tiny synthetic MoE (4 blocks x 32 experts, 4 used, Q4_0) with the experts in RAM,
# the expert cache off, and on with its misses on the CPU and on the GPU (patches/0003,
# --misses-on-gpu: the GPU reads the missed experts where they lie in RAM). Each
# cache run decodes the off run's tokens (--force) so that the logits compare step by step;
# verification batches of 4 rows take the mapped path too (llama_moe_cache::max_rows_mapped).
#   bash lab/device/misses_check.sh ENGINE_DIR OUT_DIR
set -uo pipefail
engine=${1:?engine dir}; out=${2:?out dir}
mkdir -p "$out"
export LLAMA_CPP_LIB_PATH=$engine LD_LIBRARY_PATH=$engine${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export GGML_CUDA_REGISTER_HOST=1  # the cache registers the experts' pages itself (no pin here)
python3 - <<'PY'
import dataclasses, sys
from scripts import synth_gguf  # run from the checkout's root
tiny = synth_gguf.tiny(synth_gguf.SHAPES["qwen3-30b-a3b"])
shape = dataclasses.replace(tiny, name="moe-cache", n_layer=4, n_expert=32, n_expert_used=4)
synth_gguf.write_gguf("/tmp/moe-zipf.gguf", shape, "Q4_0", "noise", routing="zipf:1")
PY
run=(python3 -m scripts.moe_cache_check /tmp/moe-zipf.gguf --gpu --prompt 40 --tokens 48 --verify 4)
"${run[@]}" > "$out/off.json" 2> "$out/off.err"
for case in "16 cpu" "16 gpu" "0 gpu"; do
  set -- $case
  misses=""; [ "$2" = gpu ] && misses=--misses-on-gpu
  "${run[@]}" --slots $1 $misses --force "$out/off.json" \
    > "$out/$1-$2.json" 2> "$out/$1-$2.err"
  rc=$?
  echo "$1 slots, misses $2: rc=$rc $(python3 -m scripts.moe_cache_check --compare "$out/off.json" "$out/$1-$2.json") $(python3 -c "import json,sys; print(json.loads(open(sys.argv[1]).read().splitlines()[-1])['stats'])" "$out/$1-$2.json" 2>&1 | tail -1)"
  grep -h "llama_moe_cache\|misses\|error" "$out/$1-$2.err" | head -5
done
