#!/usr/bin/env bash
# On the GPU machine, after tests/gpu/device_engine.sh built the patched engine from its source
# (/tmp/patched/src): ggml's own operator test, test-backend-ops (CUDA against the CPU), on
# FLASH_ATTN_EXT's one-token cases (the patch's) with patch 0007's query-head columns forced on
# (LOCALLLM_FA_VEC_GQA=1), with cases of the shapes it serves added (head sizes 64/128/256, 2-16
# query heads per KV head, q8_0 and q4_0, 512 and 4096 cells, sinks or none, two sequences),
# which the stock list has only at 64; then its perf mode on one token's attention at the shapes
# of Qwen3-30B-A3B and the 80B class, 4K-32K cells, with the patch off, on, and over f16.
#   bash lab/device/fattn_check.sh compile  # the test alone, beside the engine's build
#   bash lab/device/fattn_check.sh          # after it: results in $OUT/fattn-*.log
# A failed case leaves /tmp/fattn-off, which lab/device/queues/moe-ways.queue's lines read
# (LOCALLLM_FA_VEC_GQA=0: figures of the engine as before rather than of a wrong kernel).
# The source comes from .device-carry/test-backend-ops.cpp.xz (lab/device/carry_patched_source.sh),
# ggml's headers from the carried source or engine.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
work=/tmp/fattn-check
mkdir -p "$work" "${OUT:=/tmp/out}"
compile() {  # needs only ggml's headers (from the carried source): runs beside the builds
  mkdir -p "$work/src"
  if [ -f "$root/.device-carry/llama-src.tgz" ]; then
    tar xzf "$root/.device-carry/llama-src.tgz" -C "$work/src" llama.cpp/ggml/include
  else  # the ggml source packed with an engine built without a GPU (carry_patched_cuda.sh)
    tar xJf "$root/.device-carry/patched-engine.tar.xz" -O ggml-src.tgz | tar xzf - -C "$work/src" llama.cpp/ggml/include
  fi
  xz -dc "$root/.device-carry/test-backend-ops.cpp.xz" > "$work/tbo.cpp"
  python3 - "$work/tbo.cpp" <<'PY'
import sys
path = sys.argv[1]
s = open(path).read()
head = "std::vector<std::unique_ptr<test_case>> test_cases;\n"
served = """
    for (int hs : {64, 128, 256}) for (int nr2 : {2, 4, 6, 8, 16}) for (int kv : {512, 4096})
    for (bool sinks : {false, true}) for (ggml_type t : {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0})
        test_cases.emplace_back(new test_flash_attn_ext(hs, hs, 4, {nr2, 1}, kv, 1, true, sinks,
            0.0f, 0.0f, GGML_PREC_F32, t, t));
    for (ggml_type t : {GGML_TYPE_Q8_0, GGML_TYPE_Q4_0})
        test_cases.emplace_back(new test_flash_attn_ext(128, 128, 4, {8, 2}, 1024, 1, true, false,
            0.0f, 0.0f, GGML_PREC_F32, t, t));
"""
perf = """
    for (int kv : {4096, 16384, 32768}) for (ggml_type t : {GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0}) {
        test_cases.emplace_back(new test_flash_attn_ext(128, 128, 4, {8, 1}, kv, 1, true, false,
            0.0f, 0.0f, GGML_PREC_F32, t, t));
        test_cases.emplace_back(new test_flash_attn_ext(256, 256, 2, {8, 1}, kv, 1, true, false,
            0.0f, 0.0f, GGML_PREC_F32, t, t));
    }
"""
for fn, extra in (("make_test_cases_eval() {\n    ", served), ("make_test_cases_perf() {\n    ", perf)):
    at = s.index(fn) + len(fn)
    assert s[at:at + len(head)] == head, fn
    s = s[:at + len(head)] + extra + s[at + len(head):]
open(path, "w").write(s)
PY
  local start=$(date +%s)
  g++ -O1 -std=c++17 -c "$work/tbo.cpp" -I"$work/src/llama.cpp/ggml/include" -o "$work/tbo.o"
  echo "test-backend-ops compiled in $(( $(date +%s) - start )) s"
}
if [ "${1:-}" = compile ]; then
  compile
  exit 0
fi
[ -f "$work/tbo.o" ] || compile
g++ "$work/tbo.o" -L/tmp/patched/bin -lggml -lggml-base -lpthread -o "$work/tbo"
export LD_LIBRARY_PATH=/tmp/patched/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
LOCALLLM_FA_VEC_GQA=1 "$work/tbo" test -o FLASH_ATTN_EXT -b CUDA0 -p "nb=1," -j 8 > "$OUT/fattn-test-on.log" 2>&1 || true
# test-backend-ops prints a line per failed case and, per backend, "N/M tests passed"
passed=$(grep -Eo '[0-9]+/[0-9]+ tests passed' "$OUT/fattn-test-on.log" | head -1)
echo "FLASH_ATTN_EXT, query-head columns forced on: ${passed:-no count}, $(grep -c 'FAIL' "$OUT/fattn-test-on.log") FAIL"
if grep -q FAIL "$OUT/fattn-test-on.log" || [ -z "$passed" ] || [ "${passed%%/*}" != "$(echo "$passed" | sed -E 's#^[0-9]+/([0-9]+).*#\1#')" ]; then
  grep -m 5 FAIL "$OUT/fattn-test-on.log" || true
  touch /tmp/fattn-off  # the queue's later runs then measure with the patch off
fi
tail -3 "$OUT/fattn-test-on.log"
for mode in 0 1; do
  LOCALLLM_FA_VEC_GQA=$mode "$work/tbo" perf -o FLASH_ATTN_EXT -b CUDA0 -p 'nb=1,' > "$OUT/fattn-perf-$mode.log" 2>&1 || true
  echo "perf, LOCALLLM_FA_VEC_GQA=$mode:"; grep -E 'kv=(4096|16384|32768),nb=1,' "$OUT/fattn-perf-$mode.log" | grep -E 'hsk=(128|256)' | sed -E 's/ +/ /g' | cut -c1-230 || true
done
(cd "$root" && python3 -m lab.device.fattn_share "$OUT") || true  # off/on per case, the walk's share
