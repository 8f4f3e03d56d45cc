#!/usr/bin/env bash
# Here, after ../shared/device/prepare.sh: the wheels the GPU machine's Python lacks for the
# daemon (its image has aiohttp, numpy and pynvml, not these), into .device-carry/wheels. A
# lease whose carry lacked them spent a call on "No module named 'tomli_w'", then another on
# watchfiles (2026-12-07).
#   bash ../shared/device/prepare.sh && bash lab/device/carry_wheels.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
wheels=$root/.device-carry/wheels
mkdir -p "$wheels"
python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" platformdirs tomli-w anyio sniffio
# watchfiles has compiled code: the machine's Python (3.12) and platform
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 -d "$wheels" watchfiles
ls "$wheels"
