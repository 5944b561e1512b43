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
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
n=$(python3 -c "from clorch_repl import cuda; print(cuda.device_count())")
nvidia-smi -L; echo "GPUs: $n"
devices=$(python3 -c "print(','.join(map(str, range($n))))")
step() { local name=$1 limit=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | tail -${TAIL:-25}; }
step gpu-tests 300 python3 -m pytest tests/gpu -q -s -p no:cacheprovider
step example 240 python3 - <<PY
from examples.distributed_training import run_local
devices = [int(d) for d in "$devices".split(",")]
for precision in ("bfloat16", "float16"):
    path = f"/tmp/clorch-ddp-{precision}.pt"
    first = run_local(devices, epochs=2, accumulation=2, precision=precision, checkpoint_path=path)
    resumed = run_local(devices, epochs=4, accumulation=2, precision=precision, checkpoint_path=path, resume=True)
    print(f"{precision}: {len(devices)} NCCL ranks, epochs 1-2 final loss {first.final_loss:.5f}, "
          f"resumed epochs 3-4 final loss {resumed.final_loss:.5f}, skipped {resumed.skipped_steps}, "
          f"digests {sorted(set(resumed.param_digests.values()))}")
PY
step release-check 120 python3 -m clorch_repl.release_check --mode gpu
step collectives 240 python3 benchmarks/collectives.py --backend nccl --nproc "$n" --sizes 1M,16M,64M,256M,1G
step training 240 python3 benchmarks/training.py --nproc "$n" --rounds 3
