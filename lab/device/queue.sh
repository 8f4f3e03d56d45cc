#!/usr/bin/env bash
# A queue of benchmark commands on the GPU machine that outlives one device call.
#
#   source .device-carry/on-device.sh
#   bash lab/device/queue.sh start QUEUE_FILE   # runs its lines in turn, in the background
#   bash lab/device/queue.sh wait 560           # until the queue ends or 560 s pass,
#                                                   # then packs the results into $OUT
#
# A device call may run 10 minutes; a machine stays warm 30 s after one. The queue runs in its
# own process session (setsid), so it goes on between calls as long as the next call comes
# within the warm window: that call runs `wait` again and brings back what was written since.
# Each line of QUEUE_FILE is one shell command; `$R` in it is the results folder
# (/tmp/queue/results). A line's output goes to $R/NN.log; `#` lines are skipped.
set -euo pipefail
Q=/tmp/queue
R=$Q/results

case "${1:-}" in
  start)
    mkdir -p "$R"
    cp "$2" "$Q/queue"
    setsid bash -c '
      n=0
      while IFS= read -r line; do
        case "$line" in ""|"#"*) continue ;; esac
        n=$((n + 1)); log=$(printf "%s/%02d.log" "'"$R"'" "$n")
        echo "$(date +%s) start $n: $line" >> "'"$Q"'/progress"
        R="'"$R"'" bash -c "$line" > "$log" 2>&1 || echo "exit $?" >> "$log"
        echo "$(date +%s) end $n" >> "'"$Q"'/progress"
      done < "'"$Q"'/queue"
      touch "'"$Q"'/done"' < /dev/null > "$Q/queue.log" 2>&1 &
    echo "queue started: $(grep -cv '^\(#\|$\)' "$2") commands"
    ;;
  wait)
    if [ ! -e "$Q/queue" ]; then
      # A call that came after the warm window gets a fresh machine: waiting there would
      # spend the whole limit on nothing (a lease once lost 512 s of device time that way).
      echo "no queue on this machine (a fresh one: the last was released); start it again" >&2
      exit 3
    fi
    limit=${2:-560}
    start=$(date +%s)
    while [ ! -e "$Q/done" ] && [ $(( $(date +%s) - start )) -lt "$limit" ]; do sleep 5; done
    cat "$Q/progress" 2>/dev/null || true
    [ -e "$Q/done" ] && echo "queue done" || echo "queue still running"
    tar -czf "${OUT:?}/results.tar.gz" -C "$Q" results progress 2>/dev/null || true
    ;;
  *)
    echo "usage: $0 start QUEUE_FILE | wait [SECONDS]" >&2
    exit 2
    ;;
esac
