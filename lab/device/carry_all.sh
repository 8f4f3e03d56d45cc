#!/usr/bin/env bash
# Here, at the start of a session that will lease a GPU: everything a lease's first call needs,
# in one go (about 45 minutes on two cores; start it first and work beside it):
#   the carry (../shared/device/prepare.sh), the daemon's wheels (carry_wheels.sh), the patched
#   engine built with CUDA here (carry_patched_cuda.sh, which completes the toolkit with
#   cuda_toolkit_here.sh), and the newest llama.cpp built here (carry_newest_llama.sh --build);
#   then the prebuilt's CUDA library, which the patched one replaces, left out (slim_carry.sh).
# With both builds carried, a lease's setup took 49 s where building there took 232-431 s.
#   bash lab/device/carry_all.sh > /tmp/carry-all.log 2>&1 &
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bash ../shared/device/prepare.sh
bash lab/device/carry_wheels.sh
bash lab/device/carry_patched_cuda.sh
bash lab/device/carry_newest_llama.sh --build
bash lab/device/slim_carry.sh  # both CUDA builds within the carry's 64 MiB
du -sh .device-carry/*
