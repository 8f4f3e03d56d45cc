#!/usr/bin/env bash
# The first device call of the #65 lease: a copy of the tree in /tmp/lw (a later call lays the
# carried tree anew under the running queue), the model written while ours and the newest
# llama.cpp build side by side, then lab/device/queues/moe-ways.queue started and waited on.
#   source .device-carry/on-device.sh && bash lab/device/queues/moe-ways-start.sh
# QUEUE names another queue file (moe-ways-short.queue for a short lease).
# BASELINE=vendored-fit skips the newest build (about 200 s more than ours alone) and measures
# against the llama.cpp carried prebuilt.
set -euo pipefail
t0=$(date +%s)
rm -rf /tmp/lw && mkdir -p /tmp/lw && cp -a . /tmp/lw && cd /tmp/lw
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader; nproc
python3 -c "import tomli_w, platformdirs, watchfiles" ||  # before any build: the daemon needs them
  { echo "error: the carry lacks the daemon's wheels: run lab/device/carry_wheels.sh here" >&2; exit 1; }
[ "${SYNTH:-1}" = 0 ] ||  # SYNTH=0: a queue with no model in it (fattn-only.queue)
  python3 -c "from scripts import synth_gguf as s; print(s.ensure_model('/tmp/models', s.SHAPES['qwen3-30b-a3b'], routing='real'))" > "$OUT/synth.log" 2>&1 &
[ "${BASELINE:-newest-fit}" = vendored-fit ] ||
  bash lab/device/build_newest_llama.sh > "$OUT/newest.log" 2>&1 &
[ "${FATTN:-1}" = 0 ] ||  # FATTN=0: no build of patch 0007's test (checked on an earlier lease)
  bash lab/device/fattn_check.sh compile > "$OUT/tbo-compile.log" 2>&1 &
export BASELINE=${BASELINE:-newest-fit}
eval "$(bash tests/gpu/device_engine.sh)"
wait
tail -2 "$OUT"/synth.log "$OUT"/newest.log "$OUT"/tbo-compile.log 2>/dev/null || true
echo "builds and model: $(( $(date +%s) - t0 )) s"
bash lab/device/queue.sh start "${QUEUE:-lab/device/queues/moe-ways.queue}"
bash lab/device/queue.sh wait $(( ${FIRST_WAIT:-585} - ($(date +%s) - t0) ))  # FIRST_WAIT: a shorter first call
