#!/usr/bin/env bash
# The whole GPU check in one command, for a CUDA machine (the device machine of issue 5, or any):
# the GPU tests, the training example (bf16 and fp16, accumulation 2, a checkpoint, then resumed),
# the release check, and the collectives and training benchmarks on every visible GPU.
# Logs go to ${OUT:-/tmp/clorch-gpu-check}. Where the Jupyter stack is missing, carry wheels from
# ../shared/device/wheels.sh in .whl/ and they are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/clorch-gpu-check}; mkdir -p "$out"
if [[ -d .whl ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# a checkout that is not pip-installed lacks its entry points (the forked ranks' provisioner):
# register them from pyproject.toml, or every start would fall back to fresh interpreters
if ! python3 -c "import importlib.metadata as m, sys; sys.exit(not m.entry_points(group='jupyter_client.kernel_provisioners', name='clorch-forked-rank'))" 2>/dev/null; then
  mkdir -p /tmp/site && python3 scripts/register_entry_points.py /tmp/site \
    && case ":${PYTHONPATH:-}:" in *":/tmp/site:"*) ;; *) PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
fi
# the repository on the path: the Python files under scripts/ import clorch_repl from it
case ":${PYTHONPATH:-}:" in *":$PWD:"*) ;; *) PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1 PYTHONPATH
n=$(python3 -c "from clorch_repl import cuda; print(cuda.device_count())")
nvidia-smi -L; echo "GPUs: $n"
devices=$(seq -s, 0 $((n - 1)))  # 0,1,...,n-1
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -${TAIL:-25}; }
# (tests/gpu/test_gpu_suspend.py moves 20 GiB out and back three times: about 2 minutes of it)
step gpu-tests 480 python3 -m pytest tests/gpu -q -s -p no:cacheprovider
step example 240 python3 scripts/gpu_check_example.py --devices "$devices"
step release-check 120 python3 -m clorch_repl.tools.release_check --mode gpu
# issue 22: sharded checkpoints of a 500M-parameter FSDP2 model (about 6 GB of state with AdamW)
step checkpoint 420 python3 benchmarks/checkpoint.py --nproc "$n" --params-m 500 --rounds 3
step collectives 240 python3 benchmarks/collectives.py --backend nccl --nproc "$n" --sizes 1M,16M,64M,256M,1G
# 3 interleaved rounds of both loops (launch-bound and, since issue 12, GPU-bound) took about 27 s
# each on two H200s (docs/PERFORMANCE.md), plus the notebook start and the checkpoint part; more
# GPUs launch slower. --max-seconds starts no round after 240 s, so a slow machine still prints
# its summary before the step's limit.
step training 420 python3 benchmarks/training.py --nproc "$n" --rounds 3 --max-seconds 240
# issue 37: %clorch suspend/resume beside the driver's bare checkpoint and save + stop + start + load
step suspend 540 python3 benchmarks/suspend.py --rounds 2 --gib 20
