#!/usr/bin/env bash
# The main job: set up, then run notebooks/quickstart.ipynb headless in a real notebook kernel
# (2 CPU ranks with gloo on a machine without GPUs, every visible GPU with NCCL otherwise).
# Options go to `clorch-notebook run` (e.g. --nproc 4, --timeout 300, --output OUT.ipynb).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
clorch-notebook run notebooks/quickstart.ipynb "$@"
