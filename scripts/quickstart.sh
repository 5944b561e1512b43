#!/usr/bin/env bash
# The main job: set up, then run notebooks/quickstart.ipynb headless in a real notebook kernel
# (2 CPU ranks with gloo on a machine without GPUs, every visible GPU with NCCL otherwise).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
python scripts/run_notebook.py notebooks/quickstart.ipynb "$@"
