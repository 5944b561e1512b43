"""On a CUDA machine: ``%clorch top`` shows each rank's GPU utilisation and memory (NVML, read on
the rank's host), and ``%%distributed --profile`` traces an NCCL training cell with the GPU's
kernels (per rank: GPU compute and collectives). Skipped where there is no GPU (CI); run on the
device machine with ``python -m pytest tests/gpu -q -s``."""

from __future__ import annotations

import json
import os
import re

import pytest

from clorch_repl import cuda

pytestmark = pytest.mark.skipif(cuda.device_count() == 0, reason="needs a CUDA GPU")

WORK = """%%distributed --profile {folder}
import torch, torch.distributed as dist
x = torch.randn(4096, 4096, device=device)
for _ in range(20 if rank == 0 else 5):
    y = x @ x
dist.all_reduce(y)
torch.cuda.synchronize()
print("done", y.shape)
"""


def test_top_shows_the_gpu_and_profile_traces_nccl(tmp_path) -> None:
    from notebook_kernel import NotebookKernel

    nb = NotebookKernel()
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        started = nb.run("%clorch start")
        assert started.status == "ok" and "nccl" in started.text, started.text
        assert nb.run("%%distributed\nimport torch\nbig = torch.empty(2**30, device=device)").status == "ok"
        top = nb.run("%clorch top --once")
        print(top.text)
        rows = [line for line in top.text.splitlines() if re.match(r"\d+\s+here\s", line)]
        assert len(rows) == cuda.device_count(), top.text
        for row in rows:
            assert re.search(r"\d+ %\s+[\d.]+ GiB / [\d.]+ GiB", row), row  # GPU utilisation and memory
        folder = str(tmp_path / "prof")
        ran = nb.run(WORK.format(folder=folder), timeout=300)
        print(ran.text)
        assert ran.status == "ok", ran.text
        assert re.search(r"rank 0: \d+ ms profiled; GPU kernels: compute \d+ ms, in collectives", ran.text), ran.text
        trace = json.load(open(os.path.join(folder, "trace.json")))
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel"]
        assert any("gemm" in e["name"].lower() for e in kernels), sorted({e["name"] for e in kernels})[:10]
        if cuda.device_count() > 1:  # one NCCL rank launches no communication kernel for an all_reduce
            assert any("nccl" in e["name"].lower() for e in kernels), sorted({e["name"] for e in kernels})[:10]
        assert nb.run("%clorch stop").status == "ok"
    finally:
        nb.shutdown()
