#!/usr/bin/env bash
# Install everything the tests need, fetch the real test models, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh --test
.venv/bin/python -m scripts.fetch_test_models >/dev/null
exec .venv/bin/python -m pytest -q "$@"
