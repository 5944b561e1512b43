#!/usr/bin/env bash
# The whole GPU check in one command, for a CUDA machine (the device machine of issue 5, or any):
# the GPU tests, the training example (bf16 and fp16, accumulation 2, a checkpoint, then resumed),
# the release check, and the collectives and training benchmarks on every visible GPU.
# Logs go to ${OUT:-/tmp/clorch-gpu-check}; scripts/device_env.sh sets up a bare machine.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/clorch-gpu-check}; mkdir -p "$out"
source scripts/device_env.sh
n=$(python3 -c "from clorch_repl import cuda; print(cuda.device_count())")
nvidia-smi -L; echo "GPUs: $n"
devices=$(seq -s, 0 $((n - 1)))  # 0,1,...,n-1
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
