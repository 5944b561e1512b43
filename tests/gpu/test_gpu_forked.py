"""On a CUDA machine: ranks forked from the session's zygote (issue 39's default) are NCCL ranks like
any: each its own process below the zygote, each with its own GPU and CUDA context, while the
zygote, which imported torch before forking, holds none (a CUDA context made before a fork is
unusable in the children); a cold restart forks again; the stop leaves nothing. Skipped where there
is no GPU (CI); the same on CPU ranks: tests/integration/test_forked_start.py."""

from __future__ import annotations

import psutil
import pytest

from clorch_repl import cuda
from clorch_repl.common.procs import wait_gone
from clorch_repl.launchers import forked
from test_gpu_spares import opens_a_gpu

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

CELL = ("%%distributed\nimport os, torch, torch.distributed as dist\n"
        "t = torch.ones(1 << 20, device=device) * (rank + 1); dist.all_reduce(t); torch.cuda.synchronize()\n"
        "grand = int(open(f'/proc/{os.getppid()}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "print('forked-check', os.getpid(), grand, torch.cuda.current_device(), t[0].item(), torch.get_num_threads())")


def test_forked_nccl_ranks_have_their_gpus_and_the_zygote_none() -> None:
    from notebook_kernel import NotebookKernel

    assert forked.provisioner_registered(), (
        "clorch_repl's entry points are not registered, so ranks would start as fresh interpreters: "
        "pip install -e . (or python3 scripts/register_entry_points.py DIR with DIR on PYTHONPATH)")
    n = cuda.device_count()
    nb = NotebookKernel(env={"CLORCH_SPARES": "0"})  # cold starts and restarts: both fork
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        started = nb.run("%clorch start", timeout=300)
        assert started.status == "ok" and "fresh interpreters" not in started.text, started.text
        for attempt in ("start", "restart"):
            reply = nb.run(CELL, timeout=120)
            assert reply.status == "ok", reply.text
            rows = [line.split()[line.split().index("forked-check") + 1:] for line in reply.text.splitlines()
                    if "forked-check" in line]
            print(f"\nforked NCCL ranks after the {attempt}: {rows}")
            assert len(rows) == n, reply.text
            zygotes = {int(row[1]) for row in rows}
            assert len(zygotes) == 1, f"the ranks' grandparents differ: {rows}"
            zygote = zygotes.pop()
            assert "clorch_repl.host.zygote" in " ".join(psutil.Process(zygote).cmdline()), \
                f"a rank's grandparent is not the zygote: {psutil.Process(zygote).cmdline()}"
            assert not opens_a_gpu(zygote), "the zygote holds a CUDA context: its forked ranks' CUDA would fail"
            assert all(opens_a_gpu(int(row[0])) for row in rows), "a forked rank has no GPU open"
            assert sorted(int(row[2]) for row in rows) == [0] * n  # each sees only its own GPU, as cuda:0
            assert {float(row[3]) for row in rows} == {float(n * (n + 1) // 2)}
            if attempt == "start":
                assert nb.run("%clorch restart", timeout=300).status == "ok"
        everything = [p.pid for p in psutil.Process(nb.pid).children(recursive=True)]
        assert nb.run("%clorch stop", timeout=120).status == "ok"
        assert wait_gone(everything, 15) == [], "a rank, supervisor or the zygote outlived the stop"
    finally:
        nb.shutdown()
