"""On a CUDA machine: %clorch pull/push and --gather with NCCL ranks holding CUDA tensors, through a
real notebook kernel. Tensors reach the notebook on the CPU, and the notebook never creates a CUDA
context. Skipped where there is no GPU (CI); run on the device machine with
``python -m pytest tests/gpu -q -s``."""

from __future__ import annotations

from typing import Iterator

import pytest

from clorch_repl import cuda

from notebook_kernel import NotebookKernel, clorch_session

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")


@pytest.fixture(scope="module")
def nb() -> Iterator[NotebookKernel]:
    with clorch_session(f"--nproc {min(cuda.device_count(), 2)} --backend nccl") as kernel:
        yield kernel


def ok(nb: NotebookKernel, code: str) -> str:
    reply = nb.run(code)
    assert reply.status == "ok", reply.text
    return reply.text


def test_cuda_tensors_come_back_on_the_cpu_and_pushed_ones_can_go_to_the_gpu(nb: NotebookKernel) -> None:
    ok(nb, "%%distributed\nimport torch\nw = {'grad': torch.arange(4.0, device=device) * (rank + 1),"
           " 'where': str(device)}")
    ok(nb, "%clorch pull w")
    text = ok(nb, "import torch\nprint('PULLED', w[0]['grad'].device, w[0]['grad'].tolist(), w[0]['where'])\n"
                  "print('NOTEBOOK CUDA', torch.cuda.is_initialized())")
    assert "PULLED cpu [0.0, 1.0, 2.0, 3.0] cuda:0" in text
    assert "NOTEBOOK CUDA False" in text  # the notebook itself never touched the GPU
    ok(nb, "scale = torch.tensor([2.0])")
    ok(nb, "%clorch push scale")
    text = ok(nb, "%%distributed\nprint('ARRIVED', scale.device, (scale.to(device) * 3).item())")
    assert "ARRIVED cpu 6.0" in text
    ok(nb, "%%distributed --gather g\ntorch.ones(2, device=device) * rank")
    assert "GATHERED cpu [0.0, 0.0]" in ok(nb, "print('GATHERED', g[0].device, g[0].tolist())")


def test_identical_output_of_nccl_ranks_is_merged(nb: NotebookKernel) -> None:
    n = min(cuda.device_count(), 2)
    text = ok(nb, "%%distributed\nimport torch.distributed as dist\nt = torch.ones(1, device=device)\n"
                  "dist.all_reduce(t)\nprint('sum', t.item())\nprint('on', device, 'rank', rank)")
    label = "[rank 0]" if n == 1 else f"[ranks 0-{n - 1}]"
    assert text.count("sum ") == 1 and f"{label} sum {float(n)}" in text
    for r in range(n):
        assert f"[rank {r}] on cuda:0 rank {r}" in text  # different lines stay per rank
