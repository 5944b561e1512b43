"""On a CUDA machine: hang diagnosis with NCCL ranks through a real notebook kernel. A rank that
skips an all_reduce, a size mismatch (NCCL does not check sizes: both ranks hang), and a rank
blocked in ``torch.cuda.synchronize()`` behind a long kernel. Skipped without CUDA; run on the
device machine with ``python -m pytest tests/gpu/test_gpu_hang.py -q -s`` (the verdicts are
printed with -s for the notes)."""

from __future__ import annotations

import re
from typing import Iterator

import pytest

from clorch_repl import cuda

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

NOTICE = "clorch: no progress on any rank; "
#: torch.cuda._sleep cycles: tens of seconds of one busy kernel on any current GPU
LONG_KERNEL_CYCLES = 40_000_000_000


def notices(text: str) -> list[str]:
    found = [line[len(NOTICE):] for line in text.splitlines() if line.startswith(NOTICE)]
    for line in found:
        print("verdict:", line)
    return found


@pytest.fixture()
def nb_gpus() -> Iterator[object]:
    from notebook_kernel import NotebookKernel

    n = min(2, cuda.device_count())
    kernel = NotebookKernel()
    try:
        assert kernel.run("%load_ext clorch_repl").status == "ok"
        reply = kernel.run(f"%clorch start --nproc {n} --timeout 60 --hang-notice 5")
        assert reply.status == "ok", reply.text
        kernel.nproc = n  # type: ignore[attr-defined]
        yield kernel
    finally:
        kernel.shutdown()


def two(nb: object) -> None:
    if getattr(nb, "nproc") < 2:
        pytest.skip("needs 2 GPUs")


def test_nccl_rank_skips_all_reduce(nb_gpus) -> None:  # type: ignore[no-untyped-def]
    two(nb_gpus)
    # NCCL's all_reduce returns at once; rank 0 blocks where it needs the result (.item()).
    msg_id = nb_gpus.send("%%distributed\nimport time, torch, torch.distributed as dist\n"
                          "t = torch.ones(1024, device=device)\n"
                          "if rank == 1:\n    time.sleep(40)\nelse:\n    dist.all_reduce(t)\n    t.sum().item()\n")
    nb_gpus.wait_for_output(msg_id, NOTICE, timeout=60)
    nb_gpus.km.interrupt_kernel()
    reply = nb_gpus.collect(msg_id, timeout=120)
    [verdict] = notices(reply.text)
    assert re.match(r"all_reduce #2 \(float32\[1024\], default group\): rank 0 waits in it; "
                    r"rank 1 never called it and is at Cell In\[\d+\], line 4 in <module>", verdict), verdict


def test_nccl_size_mismatch(nb_gpus) -> None:  # type: ignore[no-untyped-def]
    two(nb_gpus)
    msg_id = nb_gpus.send("%%distributed\nimport torch, torch.distributed as dist\n"
                          "t = torch.ones(4 if rank == 0 else 8, device=device)\n"
                          "dist.all_reduce(t)\ntorch.cuda.synchronize()\n")
    nb_gpus.wait_for_output(msg_id, NOTICE, timeout=60)
    nb_gpus.km.interrupt_kernel()
    reply = nb_gpus.collect(msg_id, timeout=120)
    [verdict] = notices(reply.text)
    assert verdict.startswith("all_reduce #2 (float32[4], default group): rank 0 passed float32[4], "
                              "rank 1 passed float32[8]; ranks 0, 1 wait in it"), verdict


def test_rank_blocked_in_cuda_synchronize(nb_gpus) -> None:  # type: ignore[no-untyped-def]
    n = getattr(nb_gpus, "nproc")
    code = ("%%distributed --timeout 12\nimport torch, torch.distributed as dist\n"
            "if rank == 0:\n"
            f"    torch.cuda._sleep({LONG_KERNEL_CYCLES})\n"
            "    torch.cuda.synchronize()\n"
            "else:\n    dist.barrier()\n")
    reply = nb_gpus.run(code, timeout=300)
    assert reply.status == "error"
    text = reply.text.replace("\x1b[1m", "").replace("\x1b[0m", "")
    why = next(line for line in text.splitlines() if line.startswith("Why: "))
    print(why)
    if n >= 2:
        # NCCL implements barrier as a one-element all_reduce; torch may record either name.
        assert re.match(r"Why: \w+ #2 \(.*default group\): rank 1 waits in it; rank 0 never called it and is at "
                        r"Cell In\[\d+\], line 4 in <module>, inside synchronize\(\) .*with its CUDA stream still busy",
                        why), why
    else:
        assert re.match(r"Why: no collective is pending: rank 0 is in native code outside any collective, at "
                        r"Cell In\[\d+\], line 4 in <module>, inside synchronize\(\) .*with its CUDA stream still busy",
                        why), why
