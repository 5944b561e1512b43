"""On a CUDA machine: ``%clorch start --launcher attach`` with the printed torchrun command, one rank
per GPU, NCCL across the ranks through the callback path (nannies that call back over CurveZMQ,
kernels on TCP with Curve keys), then a restart inside the same torchrun and a stop that ends it.
Skipped where there is no GPU (CI); run on the device machine with ``python -m pytest tests/gpu -q -s``
(``scripts/gpu_check.sh`` does). It prints what the ranks printed, so a person can read the check.

The same path without GPUs, on one host and on simulated hosts: tests/integration/test_remote_ranks.py and
tests/integration/test_multihost.py."""

from __future__ import annotations

import json
import time

import pytest

from clorch_repl import cuda

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

CELL = """%%distributed
import torch, torch.distributed as dist
t = torch.full((1 << 20,), float(rank + 1), device=device)
dist.all_reduce(t)
torch.cuda.synchronize()
print(dist.get_backend(), world_size, device, torch.cuda.get_device_name(device),
      'CUDA_VISIBLE_DEVICES=' + __import__('os').environ.get('CUDA_VISIBLE_DEVICES', ''), 'sum', t[0].item())"""


def test_attach_with_torchrun_runs_nccl_across_one_rank_per_gpu() -> None:
    from notebook_kernel import NotebookKernel
    from rank_text import lines_of
    from test_remote_ranks import torchrun

    n = cuda.device_count()
    nb = NotebookKernel()
    runner = None
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        t0 = time.monotonic()
        msg_id = nb.send(f"%clorch start --launcher attach --nodes 1 --nproc-per-node {n} --listen 127.0.0.1 "
                         "--start-timeout 120")
        nb.wait_for_output(msg_id, "CLORCH_CONNECT_FILE=", timeout=60)
        printed = "".join(m["content"].get("text", "") for m in nb._held if m["msg_type"] == "stream")
        path = printed.split("CLORCH_CONNECT_FILE=", 1)[1].split()[0]
        with open(path) as fh:
            assert set(json.load(fh)) >= {"address", "token"}
        runner = torchrun(path, nproc=n)
        started = nb.collect(msg_id, timeout=180)
        took = time.monotonic() - t0
        print("\n--- %clorch start (attach) printed:\n" + started.text)
        assert started.status == "ok", started.text
        print(f"--- start until the NCCL group formed: {took:.1f} s")

        status = nb.run("%clorch status")
        print("--- %clorch status:\n" + status.text)
        assert status.status == "ok" and "GPU" in status.text.upper(), status.text

        reply = nb.run(CELL, timeout=120)
        print("--- the all_reduce cell printed:\n" + reply.text)
        assert reply.status == "ok", reply.text
        want = float(n * (n + 1) // 2)
        for r in range(n):
            (line,) = lines_of(reply.text, r)
            assert line.startswith(f"nccl {n} cuda:0 ") and line.endswith(f"sum {want}"), line

        t1 = time.monotonic()
        restarted = nb.run("%clorch restart", timeout=180)
        print(f"--- %clorch restart inside the same torchrun: {time.monotonic() - t1:.1f} s\n" + restarted.text)
        assert restarted.status == "ok", restarted.text
        again = nb.run(CELL, timeout=120)
        print("--- after the restart:\n" + again.text)
        assert again.status == "ok" and all(lines_of(again.text, r) for r in range(n)), again.text

        stopped = nb.run("%clorch stop", timeout=120)
        assert stopped.status == "ok", stopped.text
        code = runner.wait(timeout=30)
        print(f"--- torchrun exited {code} after %clorch stop")
        assert code == 0
    finally:
        nb.shutdown()
        if runner is not None and runner.poll() is None:
            runner.terminate()
            runner.wait(timeout=30)
        if runner is not None and runner.stdout is not None:
            print("--- torchrun's own output (tail):\n" + runner.stdout.read().decode(errors="replace")[-3000:])
