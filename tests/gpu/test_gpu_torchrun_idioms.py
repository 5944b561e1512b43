"""On a CUDA machine (issue 35): torchrun's GPU convention on NCCL ranks (every visible GPU) through
a real notebook kernel: ``cuda:{LOCAL_RANK}``, ``set_device(LOCAL_RANK)``, ``.to(LOCAL_RANK)`` and
plain ``"cuda"`` reach each rank's own GPU, pytorch/examples' DDP tutorial and a Lightning Fabric
script (ddp and fsdp) give the numbers real torchrun gives on the same GPUs. One GPU shows little
(LOCAL_RANK is 0); two or more show the bug this fixed. Skipped where there is no GPU (CI)."""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest

from clorch_repl import cuda
from clorch_repl.common.procs import free_port
from notebook_kernel import clorch_session
from rank_text import lines_of

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_scripts")

IDIOMS = """%%distributed
import os, torch
lr = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(lr)
a = torch.ones(1, device=f"cuda:{lr}")
b = torch.ones(1).to(lr)
c = torch.ones(1, device="cuda")
print("idioms", lr == local_rank, a.device == b.device == c.device == device, torch.cuda.current_device() == lr,
      torch.cuda.device_count() == int(os.environ["LOCAL_WORLD_SIZE"]), os.environ["CUDA_VISIBLE_DEVICES"])
"""


def torchrun(n: int, script: str, *args: str) -> dict[int, list[str]]:
    logs = tempfile.mkdtemp(prefix="torchrun-logs-")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLORCH_")}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n),
                          "--master-port", str(free_port()), "--log-dir", logs, "--redirects", "3",
                          os.path.join(SCRIPTS, script), *args], capture_output=True, text=True, timeout=300, env=env)
    found = {}
    for r in range(n):
        with open(glob.glob(os.path.join(logs, "*", "attempt_0", str(r), "stdout.log"))[0]) as fh:
            found[r] = [line for line in fh.read().splitlines() if " rank " in f" {line}"]
    assert out.returncode == 0, (out.stdout[-3000:], out.stderr[-3000:], found)
    return found


def test_local_rank_idioms_and_scripts_on_nccl_ranks() -> None:
    n = cuda.device_count()
    expected = torchrun(n, "ddp_tutorial.py", "3")
    lightning = importlib.util.find_spec("lightning") is not None
    fabric = {s: torchrun(n, "lightning_fabric.py", "gpu", s) for s in ("ddp", "fsdp")} if lightning else {}
    with clorch_session("") as nb:  # every GPU, NCCL
        idioms = nb.run(IDIOMS, timeout=120)
        assert idioms.status == "ok", idioms.text
        visible = ",".join(str(i) for i in range(n))
        for r in range(n):
            assert lines_of(idioms.text, r) == [f"idioms True True True True {visible}"], idioms.text
        ran = nb.run(f"%clorch run {os.path.join(SCRIPTS, 'ddp_tutorial.py')} 3", timeout=300)
        assert ran.status == "ok", ran.text
        for r in range(n):
            got = [line for line in lines_of(ran.text, r) if line.startswith("rank ")]  # the script's own lines
            assert got == expected[r], (ran.text, expected)
            assert f"device cuda:{r} current {r} " in expected[r][0]
        for strategy, wanted in fabric.items():
            ran = nb.run(f"%clorch run {os.path.join(SCRIPTS, 'lightning_fabric.py')} gpu {strategy}", timeout=300)
            assert ran.status == "ok", ran.text
            for r in range(n):
                got = [line for line in lines_of(ran.text, r) if line.startswith("fabric")]
                assert got == wanted[r] and f"on cuda:{r} " in got[0], (strategy, ran.text, wanted)
    print(f"GPU idioms on {n} GPU(s): DDP tutorial and Fabric {sorted(fabric) or '(no lightning)'} agree with torchrun")
