"""``%clorch why`` after a rank died during a collective says of that collective what the cell's
death report said: "ended, perhaps failed (rank 1 of its group died)", never "completed".

A try-out found the two reports disagreeing about the same all_reduce: gloo fails a survivor's
collective once its peer's sockets close, and torch's flight recorder retires the failed entry as
it does a finished one, so only the diagnosis knows to doubt it. ``%clorch why --rank 0`` weighed
rank 0's evidence without the dead rank beside it, and ``%clorch why`` after a cell the survivors
ran judged the collective by that later cell; both called it "completed". Real gloo ranks in a
real notebook kernel; what the user reads is asserted.
"""

from __future__ import annotations

import re

import pytest

from notebook_kernel import NotebookKernel, clorch_session

pytestmark = pytest.mark.slow

#: rank 1 is killed while ranks 0 and 2 wait for it in an all_reduce (#2: #1 is the start's barrier)
KILL = ("%%distributed\nimport os, signal, torch, torch.distributed as dist\n"
        "if rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(torch.ones(8))\n")
DOUBTED = "all_reduce #2 (float32[8]) group 0: ended, perhaps failed (rank 1 of its group died)"
CALLED_COMPLETED = "all_reduce #2 (float32[8]) group 0: completed"
LAST = "the last collective of ranks 0,2 was all_reduce #2 (float32[8], default group)"


def _flat(text: str) -> str:
    """What the user reads, on one line: clorch wraps its reports at a cell's width."""
    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())


def _death(nb: NotebookKernel) -> str:
    """Kill rank 1 in the all_reduce; the cell's report, flattened, after checking it doubts it."""
    died = nb.run(KILL, timeout=90)
    report = _flat(died.text)
    assert died.status == "error" and "rank 1 died" in report, report
    assert DOUBTED in report and LAST in report, report
    return report


def test_why_for_one_rank_doubts_the_collective_the_death_report_doubted() -> None:
    with clorch_session("--nproc 3 --backend gloo") as nb:
        _death(nb)
        why = nb.run("%clorch why --rank 0")
        text = _flat(why.text)
        assert why.status == "ok", text
        assert "---- rank 0 ----" in text and "---- rank 1 ----" not in text, text
        assert DOUBTED in text and CALLED_COMPLETED not in text, text


def test_why_after_a_later_cell_still_doubts_the_collective_the_rank_died_in() -> None:
    with clorch_session("--nproc 3 --backend gloo") as nb:
        _death(nb)
        later = nb.run("%%distributed\nafter = rank\nprint('later', flush=True)\n")
        assert later.status == "ok" and "later" in later.text, later.text
        why = nb.run("%clorch why")
        text = _flat(why.text)
        assert why.status == "ok", text
        # the same verdict and the same doubt as the cell's report
        assert text.startswith("rank 1 died (killed by signal SIGKILL") and LAST in text, text
        assert DOUBTED in text and CALLED_COMPLETED not in text, text
