"""What of a fresh GPU rank's join a warm spare could do ahead without holding GPU memory (issue 39:
``%clorch restart`` within 1 s; ``CLORCH_SPARE_CUDA``, clorch_repl.kernel.app._warm_cuda_driver).

    python benchmarks/cuda_init_parts.py [--variants none,cu,nvml,cu+nvml,torchinit] [--rounds 4]

Each variant is a fresh Python process (no clorch) that imports torch, does its part ahead (``cu``:
the driver's ``cuInit`` through ctypes; ``nvml``: ``nvmlInit_v2``; ``torchinit``: ``torch.cuda.init()``,
what the spare calls), waits 0.3 s, and then times what a joining rank does: ``set_device`` and a
first tensor on the GPU (the context), ``init_process_group("nccl", device_id=...)`` on a one-rank
FileStore (the eager communicator) and a first all_reduce. The variants alternate round by round,
their order reversed every other round. Printed per variant: the GPU device files its part done ahead
left open (first round; a warm spare's check, tests/gpu/test_gpu_spares.py, reads them), each part's median [min-max] in ms,
and the join's total as a ratio to ``none``'s (the baseline of the same run). CUDA machines only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r'''
import ctypes, json, os, sys, time
ahead = sys.argv[1]
import torch, torch.distributed as dist
out = {}
t = time.monotonic()
if "cu" in ahead.split("+"):
    assert ctypes.CDLL("libcuda.so.1").cuInit(0) == 0
    out["ahead: cuInit"] = time.monotonic() - t; t = time.monotonic()
if "nvml" in ahead.split("+"):
    assert ctypes.CDLL("libnvidia-ml.so.1").nvmlInit_v2() == 0
    out["ahead: nvmlInit"] = time.monotonic() - t; t = time.monotonic()
if ahead == "torchinit":
    torch.cuda.init()
    out["ahead: torch.cuda.init"] = time.monotonic() - t
def device_files():
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return sorted({link for link in links if link.startswith("/dev/nvidia")})
files = device_files()  # what the part done ahead left open (tests/gpu/test_gpu_spares.py's check reads these)
time.sleep(0.3)
t0 = time.monotonic()
torch.cuda.set_device(0); x = torch.ones(1024, device="cuda"); torch.cuda.synchronize()
t1 = time.monotonic()
dist.init_process_group("nccl", store=dist.FileStore(sys.argv[2], 1), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0))
t2 = time.monotonic()
dist.all_reduce(x); torch.cuda.synchronize()
t3 = time.monotonic()
out.update({"context": t1 - t0, "init_process_group": t2 - t1, "first all_reduce": t3 - t2, "join": t3 - t0})
print("RESULT " + json.dumps(out), flush=True)
print("FILES " + json.dumps(files), flush=True)
os._exit(0)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="none,cu,nvml,cu+nvml,torchinit")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    variants = args.variants.split(",")
    if "none" not in variants:
        variants.insert(0, "none")  # the baseline
    results: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants if r % 2 == 0 else variants[::-1]:
            with tempfile.TemporaryDirectory() as tmp:
                proc = subprocess.run([sys.executable, "-c", CHILD, variant, os.path.join(tmp, "store")],
                                      capture_output=True, text=True, timeout=180)
            found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if not found:
                sys.exit(f"{variant}: the child failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            results[variant].append(json.loads(found[0][len("RESULT "):]))
            if r == 0:
                opened = [line[len("FILES "):] for line in proc.stdout.splitlines() if line.startswith("FILES ")]
                print(f"{variant:10s} GPU device files open after the part done ahead: {opened[0] if opened else '?'}")
    base = statistics.median(r["join"] for r in results["none"])
    for variant, runs in results.items():
        parts = "  ".join(f"{key} {statistics.median(r[key] for r in runs) * 1e3:.0f} ms "
                          f"[{min(r[key] for r in runs) * 1e3:.0f}-{max(r[key] for r in runs) * 1e3:.0f}]"
                          for key in runs[0])
        joins = sorted(r["join"] / base for r in runs)
        print(f"{variant:10s} {parts}  join / none's {statistics.median(joins):.2f} [{joins[0]:.2f}-{joins[-1]:.2f}]")


if __name__ == "__main__":
    main()
