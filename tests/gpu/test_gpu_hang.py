"""On a CUDA machine: hang diagnosis with NCCL ranks through a real notebook kernel. A rank that
skips an all_reduce, a size mismatch (NCCL does not check sizes: a rank waits for data that never
comes), and a rank blocked in ``torch.cuda.synchronize()`` behind a long kernel; then the same
analysis on answers recorded from plain NCCL ranks (tests/hang_scenarios.py), and the fact the
live probe relies on: a rank blocked in ``.item()`` or ``synchronize()`` still runs its other
threads. Skipped without CUDA; run on the device machine with
``python -m pytest tests/gpu/test_gpu_hang.py -q -s`` (the verdicts are printed with -s for the
notes).

Sequence numbers: an NCCL session forms its group without a barrier (``device_id`` connects the
communicator eagerly), so a cell's first collective is #1; a gloo session's start-up barrier makes
it #2 there (tests/integration/test_hang_notebook.py).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from typing import Any, Iterator

import pytest

from clorch_repl import cuda
from rank_text import said

pytestmark = pytest.mark.skipif(not cuda.available(), reason="needs CUDA GPUs")

NOTICE = "clorch: no progress on any rank; "
#: torch.cuda._sleep cycles: tens of seconds of one busy kernel on any current GPU
LONG_KERNEL_CYCLES = 40_000_000_000
#: A cell's first collective in an NCCL session (see the module docstring).
FIRST = 1


def notices(text: str) -> list[str]:
    found = said(text, NOTICE)  # wrapped at the cell's width: one line per notice again
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


def noticed(nb: Any, msg_id: str, timeout: float = 60) -> str:
    """Wait for the live notice, then interrupt; the cell's text. Without a notice, the report
    after the interrupt (verdict and each rank's evidence) is printed before failing."""
    from queue import Empty

    try:
        nb.wait_for_output(msg_id, NOTICE, timeout=timeout)
    except Empty:
        nb.km.interrupt_kernel()
        text = nb.collect(msg_id, timeout=120).text
        print(text)
        pytest.fail(f"no live notice within {timeout:g} s:\n{text}")
    nb.km.interrupt_kernel()
    return nb.collect(msg_id, timeout=120).text


def two(nb: object) -> None:
    if getattr(nb, "nproc") < 2:
        pytest.skip("needs 2 GPUs")


def test_nccl_rank_skips_all_reduce(nb_gpus) -> None:  # type: ignore[no-untyped-def]
    two(nb_gpus)
    # NCCL's all_reduce returns at once; rank 0 blocks where it needs the result (.item()).
    msg_id = nb_gpus.send("%%distributed\nimport time, torch, torch.distributed as dist\n"
                          "t = torch.ones(1024, device=device)\n"
                          "if rank == 1:\n    time.sleep(40)\nelse:\n    dist.all_reduce(t)\n    t.sum().item()\n")
    [verdict] = notices(noticed(nb_gpus, msg_id))
    assert re.fullmatch(rf"all_reduce #{FIRST} \(float32\[1024\], default group\): rank 0 waits in it; "
                        r"rank 1 never called it and is at Cell In\[\d+\], line 4 in <module>", verdict), verdict


def test_nccl_size_mismatch(nb_gpus) -> None:  # type: ignore[no-untyped-def]
    two(nb_gpus)
    # Sizes far apart: the rank with more data surely waits for what the other never sends (with
    # 4 against 8 elements NCCL may pair them up); the other may finish with a wrong sum.
    msg_id = nb_gpus.send("%%distributed\nimport torch, torch.distributed as dist\n"
                          "t = torch.ones(4 if rank == 0 else 1 << 20, device=device)\n"
                          "dist.all_reduce(t)\ntorch.cuda.synchronize()\n")
    [verdict] = notices(noticed(nb_gpus, msg_id))
    assert re.fullmatch(rf"all_reduce #{FIRST} \(float32\[(4|1048576)\], default group\): rank 0 passed "
                        r"float32\[4\], rank 1 passed float32\[1048576\]; (ranks 0-1 wait|rank [01] waits) in it",
                        verdict), verdict


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
    print(text)  # the report: verdict, then each rank's collectives and stack
    why = "Why: " + said(text, "Why: ")[0]  # wrapped at the cell's width: one line again
    if n >= 2:
        # NCCL's barrier is a one-element all_reduce, recorded as all_reduce_barrier: named barrier().
        assert re.match(rf"Why: barrier #{FIRST} \(default group\): rank 1 waits in it; rank 0 never called it and "
                        r"is at Cell In\[\d+\], line 4 in <module>, inside synchronize\(\) "
                        r"\(torch/cuda/__init__\.py:\d+\), with its CUDA stream still busy$", why), why
    else:
        assert re.match(r"Why: no collective is pending: rank 0 is in native code outside any collective, at "
                        r"Cell In\[\d+\], line 4 in <module>, inside synchronize\(\) .*with its CUDA stream still busy",
                        why), why


# ------------------------------------------------------------------ plain NCCL ranks, recorded
def recorded(name: str, tmp_path: Any) -> list[Any]:
    """Run scenario ``name`` of tests/hang_scenarios.py on 2 NCCL ranks (one GPU each); their
    answers, as the probe gave them while the ranks were blocked."""
    import hang_scenarios

    if cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    states = hang_scenarios.record(name, 2, str(tmp_path), "nccl")
    keep = os.environ.get("CLORCH_KEEP_ANSWERS")  # a folder: the answers become CPU test data
    if keep:
        for state in states:
            with open(os.path.join(keep, f"nccl-{name}-{state.rank}.json"), "w") as dst:
                json.dump(state.answer, dst)
    return states


def test_recorded_nccl_ranks_skip(tmp_path: Any) -> None:
    from clorch_repl.diagnosis import render
    from clorch_repl.diagnosis.analyse import analyse

    states = recorded("skip", tmp_path)
    entries = [e for s in states for e in s.answer["fr"]["entries"]]
    print("recorders:", sorted({e.get("recorder") for e in entries}),
          "names:", sorted({e.get("profiling_name") for e in entries}))
    verdict = analyse(states)
    print("verdict:", verdict.sentence)
    print(render.report(verdict, states))
    assert verdict.hang and verdict.seq == 3 and verdict.waiting == [0] and verdict.missing == [1]
    assert verdict.sentence.startswith("all_reduce #3 (float32[1024], default group): rank 0 waits in it; "
                                       "rank 1 never called it and is at ")
    assert "in load_batch()" in verdict.sentence
    text = render.report(verdict, states)
    assert "barrier #1 (no tensor) group 0: completed" in text  # NCCL's all_reduce_barrier, named barrier
    assert "all_reduce #2 (float32[1024]) group 0: completed" in text


def test_recorded_nccl_ranks_sizes(tmp_path: Any) -> None:
    from clorch_repl.diagnosis.analyse import analyse

    verdict = analyse(recorded("sizes", tmp_path))
    print("verdict:", verdict.sentence)
    assert verdict.hang and verdict.mismatch and verdict.seq == 3
    assert re.fullmatch(r"all_reduce #3 \(float32\[(4|1048576)\], default group\): rank 0 passed float32\[4\], "
                        r"rank 1 passed float32\[1048576\]; (ranks 0-1 wait|rank [01] waits) in it", verdict.sentence)


@pytest.mark.parametrize("block", ["item", "synchronize"])
def test_a_rank_blocked_on_its_gpu_still_runs_other_threads(block: str) -> None:
    """What the live probe relies on: ``.item()`` and ``synchronize()`` release the GIL while they
    wait for the GPU, so the rank's control thread can answer."""
    import torch

    ticks = [0]
    stop = threading.Event()

    def count() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.01)

    x = torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    time.sleep(0.1)
    torch.cuda._sleep(2_000_000_000)  # about a second of one busy kernel
    before, start = ticks[0], time.monotonic()
    if block == "item":
        (x + 1).sum().item()
    else:
        torch.cuda.synchronize()
    blocked_s, during = time.monotonic() - start, ticks[0] - before
    stop.set()
    thread.join()
    print(f"{block}: blocked {blocked_s:.2f} s, other thread ran {during} times meanwhile")
    assert blocked_s > 0.3, "the kernel was too short to tell"
    assert during >= blocked_s / 0.01 * 0.5
