#!/usr/bin/env bash
# The tests: set up, then pytest (real worker kernels and real 2-rank gloo groups on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python -m pytest -q "$@"
