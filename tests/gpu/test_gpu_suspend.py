"""On a CUDA machine with a driver that has the checkpoint API (570 or later): ``%clorch suspend``
gives the GPU back and ``%clorch resume`` brings every tensor back (issue 37). One NCCL rank holds
a model, its AdamW state and 20 GiB of tensors; three times over: suspend, nvidia-smi shows the
rank's memory freed, a cell is refused saying the session is suspended, resume, and the next
training step equals the one a run without the suspends takes. Skipped where there is no GPU (CI).

    python -m pytest tests/gpu/test_gpu_suspend.py -q -s
"""

from __future__ import annotations

import os
import re

import pytest

from clorch_repl import cuda
from clorch_repl.host import cuda_checkpoint
from clorch_repl.session.suspend import gpu_used
from notebook_kernel import clorch_session
from rank_text import lines_of

pytestmark = [pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs"),
              pytest.mark.skipif(cuda.available() and cuda_checkpoint.api_problem() is not None,
                                 reason=str(cuda_checkpoint.api_problem()))]

GIB = 20
SETUP = f"""%%distributed
import os, torch, torch.distributed as dist
def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
def step(model, opt, i):
    g = torch.Generator(device=device).manual_seed(i)
    x = torch.randn(64, 2048, device=device, generator=g)
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.item(), sum(p.double().sum().item() for p in model.parameters())
reference = make()
expected = [step(*reference, i) for i in range(4)]   # the run without a suspend
del reference
torch.cuda.empty_cache()
model, opt = make()
assert step(model, opt, 0) == expected[0]
def checksum_of(t):   # in 1 GiB pieces: no 40 GiB float64 copy left in the allocator's cache
    return sum(piece.double().sum().item() for piece in t.split(2**28))
big = torch.randn({GIB} * 2**30 // 4, device=device)
checksum = checksum_of(big)
torch.cuda.synchronize()
torch.cuda.empty_cache()
print('pid', os.getpid(), flush=True)
"""

SUSPENDED = re.compile(r"clorch: suspended rank 0 in (\d+\.\d) s: ([\d.]+ GiB) of GPU memory moved to host memory")
RESUMED = re.compile(r"clorch: resumed rank 0 in (\d+\.\d) s")
GPU = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()  # rank 0's


def on_gpu(pid: int) -> int:
    """What rank 0 holds: its process's figure where nvidia-smi lists it, else its GPU's (the
    session is alone on it here)."""
    by_pid = cuda.memory_by_pid()
    return by_pid[pid] if pid in by_pid else (gpu_used(GPU) or 0)


def test_suspend_frees_the_gpu_and_resume_keeps_every_tensor_three_times() -> None:
    with clorch_session("--nproc 1 --backend nccl") as nb:
        setup = nb.run(SETUP, timeout=600)
        assert setup.status == "ok", setup.text
        pid = int(lines_of(setup.text, 0)[-1].split()[1])
        held = on_gpu(pid)
        assert held > GIB * 2**30, f"rank 0 (pid {pid}) holds {held} bytes before the suspend"
        for i in range(1, 4):
            suspended = nb.run("%clorch suspend", timeout=600)
            assert suspended.status == "ok", suspended.text
            took = SUSPENDED.search(suspended.text)
            assert took, suspended.text
            left = on_gpu(pid)
            assert left < 2**30, f"round {i}: GPU {GPU} still holds {left} bytes while rank 0 is suspended"
            status = nb.run("%clorch status")
            assert "the session is suspended" in status.text and "held in host memory" in status.text, status.text
            refused = nb.run("%%distributed\nprint('ran')\n")
            assert refused.status == "error" and "%clorch resume" in refused.text, refused.text
            assert "ran" not in lines_of(refused.text, 0)

            resumed = nb.run("%clorch resume", timeout=600)
            assert resumed.status == "ok", resumed.text
            back = RESUMED.search(resumed.text)
            assert back, resumed.text
            assert on_gpu(pid) > GIB * 2**30
            after = nb.run(f"%%distributed\nprint(checksum_of(big) == checksum, "
                           f"step(model, opt, {i}) == expected[{i}])\n"
                           "t = torch.ones(4, device=device)\ndist.all_reduce(t)\nprint(t.sum().item())\n",
                           timeout=300)
            assert after.status == "ok", after.text
            assert lines_of(after.text, 0) == ["True True", "4.0"], after.text
            print(f"round {i}: suspend {took.group(1)} s ({took.group(2)}), resume {back.group(1)} s", flush=True)
