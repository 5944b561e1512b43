#!/usr/bin/env bash
# Issue 39's speed figures in one command, for a CUDA machine: the launch-bound loop against
# torchrun (DDP and FSDP2), the sharded checkpoint's load, save and asynchronous stall, restarts
# with warm spares, and the 64-rank start with its empty cell. STEPS picks some of them
# (default: all, in this order: launch launch-fsdp checkpoint restart scale; named only: launch-rounds,
# launch-fresh, fork, spare-cuda, relay-ab, priority, floor, layers, cell64, cell64-ab, timeline); logs go to
# ${OUT:-/tmp/clorch-speed-check}. ROUNDS (checkpoint rounds, default 3), LOAD_PAIRS (its loads side by
# side, default 12) and PROFILE (checkpoint.py's --profile lines, default 0) tune the checkpoint step.
# About 9 minutes in all on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/clorch-speed-check}; mkdir -p "$out"; out=$(cd "$out" && pwd)  # (steps may run from another tree)
source scripts/device_env.sh
steps=" ${STEPS:-launch launch-fsdp checkpoint restart scale} "
n=$(python3 -c "from clorch_repl import cuda; print(cuda.device_count())")
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null) defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"
want() { [[ $steps == *" $1 "* ]]; }
# the launch-bound loop against torchrun, both alive and handed the loop in turn (launch_pace.py:
# pairs of blocks, with an interval of the ratio's median); training.py's rounds as "launch-rounds"
want launch && step launch 150 python3 benchmarks/launch_pace.py --nproc "$n" --pairs 40
want launch-fsdp && step launch-fsdp 150 python3 benchmarks/launch_pace.py --nproc "$n" --pairs 40 --strategy fsdp
want launch-rounds && step launch-rounds 150 python3 benchmarks/training.py --nproc "$n" --rounds 3 --cases launch --skip-checkpoint --max-seconds 100
# the same loop with the ranks started as fresh interpreters, not forked from the zygote (not in the default set)
want launch-fresh && CLORCH_FORK_RANKS=0 step launch-fresh 150 python3 benchmarks/training.py --nproc "$n" --rounds 3 --cases launch --skip-checkpoint --max-seconds 100
want checkpoint && step checkpoint 300 python3 benchmarks/checkpoint.py --nproc "$n" --params-m 500 --rounds "${ROUNDS:-3}" --load-pairs "${LOAD_PAIRS:-12}" --profile "${PROFILE:-0}"
# issue 39's forked-rank question: is a forked rank's loop slower than a fresh one's here, and are
# transparent huge pages why (not in the default set)
want fork && step fork 150 python3 benchmarks/fork_loop.py --device cuda --start-args "--nproc 1" --instances 1 --rounds 8
# a warm spare that set up the CUDA driver ahead (CLORCH_SPARE_CUDA=1) against one that did not, alternated,
# with the GPU test of spares under it (not in the default set: the experiment of docs/PERFORMANCE.md)
if want spare-cuda; then
  step cuda-parts 200 python3 benchmarks/cuda_init_parts.py --variants none,torchinit --rounds 2  # (which device files cuInit opens)
  for i in 1 2; do for v in 0 1; do
    CLORCH_SPARE_CUDA=$v step "spare-cuda-$v-$i" 120 python3 benchmarks/cell_latency.py --iters 5 --nprocs "$n" --backend nccl --restarts 3 --starts 0
  done; done
  CLORCH_SPARE_CUDA=1 step spare-cuda-test 180 python3 -m pytest tests/gpu/test_gpu_spares.py -q -s -p no:cacheprovider
fi
# the relay at 64 gloo ranks from this checkout and from each tree in AB_TREES (other versions of
# clorch_repl, e.g. `git archive publish-only | tar -x -C .ab/publish`, carried with .ab), alternated
# twice (not in the default set): relay_cost.py's notebook CPU a rank a cell, wall, and timeline;
# first, in this checkout, the compact reply against the Jupyter form in one session (--ab-compact)
if want relay-ab; then
  step relay-ab-compact 200 python3 benchmarks/relay_cost.py --nprocs 64 --cells 100 --ab-compact 8
  for i in 1 2; do t=0; for tree in "$PWD" ${AB_TREES:-}; do
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD step "relay-ab-$t-$(basename "$tree")-$i" 150 \
       python3 benchmarks/relay_cost.py --nprocs 64 --cells 100 --blocks 2 --timeline)
    t=$((t + 1))
  done; done
fi
# the ranks' CPU priority (nice 5, SCHED_BATCH) against the normal one, for the 64-rank empty cell (not in the default set)
# how far the relay is from its floor (bare sends and receives, nothing checked or booked) at 64
# and 16 gloo ranks, and the 64-rank empty cell beside `pass` alone (not in the default set)
want floor && step floor 240 python3 benchmarks/relay_floor.py --nprocs 64,16 --cells 100 --pairs 6
# where a rank's CPU goes in an empty cell, layer by layer, at 64 and 16 gloo ranks (not in the default set)
want layers && step layers 200 python3 benchmarks/rank_layers.py --nprocs 64,16 --cells 300
want cell64 && step cell64 200 python3 benchmarks/start_scale.py --nprocs 64 --repeats 1 --iters 100 --fresh-max 0
# the 64-rank empty cell split into its stages, in the client, the notebook kernel and every rank (not in the default set)
want timeline && step timeline 200 python3 benchmarks/cell_timeline.py --nprocs 64 --cells 150
# the same from this checkout and from each tree in AB_TREES (as relay-ab), alternated twice (not in the default set)
if want cell64-ab; then
  for i in 1 2; do t=0; for tree in "$PWD" ${AB_TREES:-}; do
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD step "cell64-ab-$t-$(basename "$tree")-$i" 150 \
       python3 benchmarks/start_scale.py --nprocs 64 --repeats 1 --iters 100 --fresh-max 0)
    t=$((t + 1))
  done; done
fi
want priority && step priority 300 python3 benchmarks/rank_priority.py --nprocs 64 --rounds 4 --iters 60
want restart && step restart 120 python3 benchmarks/cell_latency.py --iters 20 --nprocs "$n" --backend nccl --restarts 3 --starts 1
want scale && step scale 200 python3 benchmarks/start_scale.py --nprocs 64 --repeats 2 --iters 100 --fresh-max 16 --profile 30
exit 0
