#!/usr/bin/env bash
# The tests: set up, then pytest (real worker kernels and real 2-rank gloo groups on the CPU).
#   bash scripts/test.sh              everything (what CI runs)
#   bash scripts/test.sh --fast       the fast unit half only: the tests in tests/unit, which start no
#                                     process (tests/conftest.py), in seconds; it skips the set-up when
#                                     .venv already has clorch_repl (run scripts/setup.sh after
#                                     changing dependencies)
# Other arguments go to pytest (a file, -k, -m "not browser", ...).
set -euo pipefail
cd "$(dirname "$0")/.."
fast=0
for arg in "$@"; do [[ $arg == --fast ]] && fast=1; done
if [[ $fast == 1 ]] && [[ -x .venv/bin/python ]] && .venv/bin/python -c "import clorch_repl" >/dev/null 2>&1; then
  :  # the editable install already sees the working tree
else
  bash scripts/setup.sh
fi
. .venv/bin/activate
python -m pytest -q "$@"
