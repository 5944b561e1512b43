"""On a CUDA machine: ``%clorch run`` of the tests' own torchrun DDP script on NCCL ranks (every
visible GPU) through a real notebook kernel, run twice (the second resumes from rank 0's
snapshot), then init_process_group's agreement with the NCCL group (``device_id=device`` and
``cuda:{LOCAL_RANK}`` accepted, another GPU or gloo refused) and a collective on ``device`` after. Skipped where there is no GPU
(CI); the same on gloo: tests/integration/test_run_script.py."""

from __future__ import annotations

import os
import time

import pytest

from clorch_repl import cuda
from notebook_kernel import clorch_session
from rank_text import lines_of

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

DDP = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_scripts", "ddp_resume.py")


def test_a_torchrun_ddp_script_on_nccl_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    n = cuda.device_count()
    snap = tmp_path / "snap.pt"
    with clorch_session("") as nb:  # every GPU, NCCL
        t0 = time.monotonic()
        first = nb.run(f"%clorch run {DDP} --epochs 2 --snapshot {snap}", timeout=300)
        took = time.monotonic() - t0
        assert first.status == "ok", first.text
        for r in range(n):
            epochs = [line.split(" loss")[0] for line in lines_of(first.text, r) if line.startswith("epoch")]
            assert epochs == [f"epoch {e} rank {r} samples {-(-256 // n)}" for e in (0, 1)], first.text
        second = nb.run(f"%clorch run {DDP} --epochs 3 --snapshot {snap}", timeout=300)
        assert second.status == "ok", second.text
        assert all("resumed from epoch 1" in lines_of(second.text, r) for r in range(n)), second.text
        weights = {tuple(line for line in lines_of(second.text, r) if line.startswith("weights")) for r in range(n)}
        assert len(weights) == 1, second.text  # DDP kept the replicas equal

        check = nb.run("%%distributed\nimport torch, torch.distributed as dist\nfrom clorch_repl.errors import GroupConflict\n"
                       "dist.init_process_group('nccl', device_id=device)\n"
                       "dist.init_process_group(backend='nccl', device_id=torch.device('cuda', local_rank), rank=rank)\n"
                       "for kwargs in ({'backend': 'gloo'}, {'device_id': torch.device('cuda', local_rank + 1)}):\n"
                       "    try:\n        dist.init_process_group(**kwargs)\n"
                       "    except GroupConflict as exc:\n        print('refused', str(exc).split(': ', 1)[1])\n"
                       "t = torch.ones(4, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
                       "print('sum', t[0].item(), t.device.type, dist.get_backend())", timeout=120)
        assert check.status == "ok", check.text
        total = float(sum(range(1, n + 1)))
        for r in range(n):
            shown = lines_of(check.text, r)
            assert len(shown) == 3 and shown[2] == f"sum {total} cuda nccl", check.text
            assert shown[0].startswith("refused backend='gloo', but the session's group uses nccl"), check.text
            assert shown[1].startswith(f"refused device_id=cuda:{r + 1}, but this rank's GPU is cuda:{r}"), check.text
    print(f"TIMING %clorch run of two DDP epochs on {n} NCCL rank(s): {took:.2f} s")
