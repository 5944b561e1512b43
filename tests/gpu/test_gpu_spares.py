"""On a CUDA machine: a GPU session keeps warm spares by default; they hold no GPU memory (no CUDA
context); a restart after a rank's death and after a hang makes them the ranks, with a working NCCL
group in fresh processes; ``--spares 0`` keeps none. Prints the restart times and what the spares
cost. Skipped where there is no GPU (CI); the same behaviour on CPU ranks: tests/integration/test_spares.py."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from clorch_repl import cuda
from clorch_repl.common import env_vars

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

GROUP = ("%%distributed\nimport os, torch, torch.distributed as dist\nt = torch.ones(1 << 20, device=device) * (rank + 1)\n"
         "dist.all_reduce(t); torch.cuda.synchronize()\nprint(os.getpid(), 'marker' in globals(), t[0].item())\nmarker = 1")


def opens_a_gpu(pid: int) -> bool:
    """Whether the process has a GPU device open (/dev/nvidia*). Not the same as holding GPU
    memory: a spare that set up the CUDA driver ahead (``CLORCH_SPARE_CUDA=1``, cuInit) has
    /dev/nvidia0, /dev/nvidia-uvm and /dev/nvidiactl open with no context (measured on an H100,
    benchmarks/cuda_init_parts.py); :func:`gpu_contexts` is the check that matters."""
    fds = f"/proc/{pid}/fd"
    links = []
    for fd in os.listdir(fds):
        try:
            links.append(os.readlink(os.path.join(fds, fd)))
        except OSError:  # closed meanwhile
            continue
    return any(link.startswith("/dev/nvidia") and link not in ("/dev/nvidiactl",) for link in links)


def gpu_contexts(settled: int | None = None, within_s: float = 15.0) -> int:
    """How many processes hold a CUDA context (GPU memory) on this machine's GPUs, as the driver
    counts them (``nvidia-smi --query-compute-apps``): only their number, since the pids it gives
    are the host's inside a container. The GPU machine runs nothing else but the processes of
    earlier tests, which may still be exiting: with ``settled``, asked again for up to
    ``within_s`` while there are more than that (a process still exiting goes away meanwhile; a
    spare that holds a context does not). Seen once in a whole GPU run: 2 contexts with 1 rank, 1
    in a run of this file alone and in every run since."""
    deadline = time.monotonic() + within_s
    while True:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        count = len([line for line in out.splitlines() if line.strip()])
        if settled is None or count <= settled or time.monotonic() > deadline:
            return count
        time.sleep(0.5)


def ready_spares(nb, timeout: float = 120.0) -> tuple[list[int], str]:
    deadline = time.monotonic() + timeout
    while True:
        text = nb.run("%clorch status").text
        found = re.search(r"warm spares for the next %clorch restart: \d+ \(pids ([\d, ]+)\), ready, (\S+ \S+) resident", text)
        if found:
            return [int(p) for p in found.group(1).split(", ")], found.group(2)
        assert time.monotonic() < deadline, text
        time.sleep(0.5)


def nb_rank_pids(nb, n: int) -> list[int]:
    text = nb.run("%clorch status").text
    return [int(m) for m in re.findall(r"^\d+\s+\S+\s+(\d+)\s+cuda", text, re.M)][:n]


def test_gpu_restarts_take_warm_spares_that_hold_no_gpu_memory() -> None:
    from notebook_kernel import NotebookKernel
    from rank_text import lines_of

    n = cuda.device_count()
    want = float(n * (n + 1) // 2)
    nb = NotebookKernel()
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        assert nb.run("%clorch start").status == "ok"
        assert nb.run(GROUP).status == "ok"
        for situation, before in (("after a death", f"%%distributed --ranks {n - 1}\nimport os; os._exit(3)"),
                                  ("after a hang", "%%distributed --timeout 3\nimport torch.distributed as dist\n"
                                                   "if rank == 0: dist.barrier()" if n > 1 else None)):
            spares, memory = ready_spares(nb)
            on_gpu = [pid for pid in spares if opens_a_gpu(pid)]
            ranks_on_gpu = [pid for pid in nb_rank_pids(nb, n) if opens_a_gpu(pid)]
            contexts = gpu_contexts(settled=n)
            print(f"\nwarm spares {spares}: {memory} resident in all; with a GPU device file open: {on_gpu} "
                  f"(ranks with one open: {ranks_on_gpu}); processes holding a CUDA context: {contexts}")
            assert len(ranks_on_gpu) == n, "the check itself sees no GPU open in the ranks"
            assert contexts == n, f"{contexts} processes hold a CUDA context: the {n} ranks, and a spare?"
            if env_vars.SPARE_CUDA.get() == "0":  # (with the driver set up ahead, its device files are open)
                assert not on_gpu, "a spare has a GPU open"
            if before is not None:
                assert nb.run(before, timeout=120).status == "error"
            t0 = time.monotonic()
            restarted = nb.run("%clorch restart", timeout=180)
            reply = nb.run(GROUP, timeout=120)
            took = time.monotonic() - t0
            print(f"restart {situation} until an all_reduce on every fresh rank: {took:.2f} s\n{reply.text}")
            assert restarted.status == "ok" and "warm spare rank(s) taken" in restarted.text, restarted.text
            assert reply.status == "ok", reply.text
            for r in range(n):
                (line,) = lines_of(reply.text, r)
                assert line == f"{spares[r]} False {want}", line
        assert nb.run("%clorch stop").status == "ok"
        assert nb.run("%clorch start --spares 0").status == "ok"
        time.sleep(3)
        assert "warm spares" not in nb.run("%clorch status").text
        assert nb.run("%clorch stop").status == "ok"
    finally:
        nb.shutdown()
