#!/usr/bin/env bash
# Set up (once) the virtual environment .venv with clorch_repl and its test tools (pytest, nbclient;
# jupyterlab and selenium for the browser test, which drives Debian's chromium).
# torch is installed first, pinned, so that pip never resolves the bare `torch>=2.11` requirement
# to whatever build the index offers: TORCH_SPEC overrides the pin (e.g. a CUDA build's version).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [[ ! -x .venv/bin/python ]]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; }; then
    # The CPU build is only on PyTorch's own index, which this project does not name (README,
    # "torch on a machine without a GPU"): say so before a download of gigabytes starts.
    echo "setup: no GPU here (nvidia-smi lists none): $TORCH_SPEC from the default index is the CUDA build" \
         "(gigabytes) unless your pip configuration offers a CPU wheel; to use the CPU build, install it" \
         "into .venv first (README: 'torch on a machine without a GPU')"
  fi
  echo "setup: installing $TORCH_SPEC"
  python -m pip install -q "$TORCH_SPEC"
fi
python -m pip install -q -e '.[test,browser]'
python -c "import clorch_repl, torch, jupyter_client, ipykernel; print(f'setup: clorch_repl {clorch_repl.__version__}, torch {torch.__version__}, python', __import__('sys').version.split()[0])"
