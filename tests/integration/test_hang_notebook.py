"""Hang diagnosis in a real notebook kernel (jupyter_client, as JupyterLab drives it) with real
2- and 3-rank gloo sessions: the live notice, the failure reports and ``%clorch why`` must name
the op, its sequence number, the ranks and the line where each rank is.

Sequence numbers: the session's own barrier when the group forms is collective #1, so the first
collective of the first cell is #2 (torch numbers them the same way in its own tools).
"""

from __future__ import annotations

import re
import time
from typing import Iterator

import pytest

from rank_text import said
from notebook_kernel import NotebookKernel, Reply

NOTICE = "clorch: no progress on any rank; "


def start(nproc: int, pg_timeout: int, notice: float) -> NotebookKernel:
    kernel = NotebookKernel()
    try:
        assert kernel.run("%load_ext clorch_repl").status == "ok"
        # gloo named: on a GPU machine the default would be NCCL, whose collectives return at once
        reply = kernel.run(f"%clorch start --nproc {nproc} --backend gloo --timeout {pg_timeout} "
                           f"--hang-notice {notice:g}")
        assert reply.status == "ok", reply.text
    except BaseException:
        kernel.shutdown()
        raise
    return kernel


@pytest.fixture()
def nb2() -> Iterator[NotebookKernel]:
    kernel = start(2, pg_timeout=60, notice=3)
    try:
        yield kernel
    finally:
        kernel.shutdown()


def notice_of(text: str) -> list[str]:
    return said(text, NOTICE)  # wrapped at the cell's width: one line per notice again


def until_agreed(done: str, indent: str, group: str = "", leave: str = "break") -> str:
    """Cell lines for the inside of a ``while True:`` loop: all-reduce the flag ``done`` and
    ``leave`` once any rank has set it, so that all ranks leave in the same iteration and none is
    left alone in a collective the others never call (which would be a real hang)."""
    return "".join(f"{indent}{line}\n" for line in (
        f"t = torch.tensor([float({done})])", f"dist.all_reduce(t{', group=' + group if group else ''})",
        "if t.item() > 0:", f"    {leave}"))


def the_notice(reply: Reply) -> str:
    """The cell's one live notice (failing when there is none, or more than one)."""
    notices = notice_of(reply.text)
    assert len(notices) == 1, reply.text
    return notices[0]


def test_a_rank_that_skips_an_all_reduce_is_named_live_with_its_line() -> None:
    nb = start(3, pg_timeout=12, notice=3)
    try:
        code = ("%%distributed\nimport time, torch, torch.distributed as dist\n"
                "def load_batch():\n"
                "    time.sleep(14)\n"
                "t = torch.ones(1024)\n"
                "if rank == 1:\n    load_batch()\nelse:\n    dist.all_reduce(t)\n")
        reply = nb.run(code, timeout=90)
        notices = notice_of(reply.text)
        assert len(notices) == 1, reply.text  # once, not every few seconds
        assert re.fullmatch(r"all_reduce #2 \(float32\[1024\], default group\): ranks 0,2 wait in it; "
                            r"rank 1 never called it and is at Cell In\[\d+\], line 3 in load_batch\(\)",
                            notices[0]), notices[0]
        # The ranks that waited raised the group's timeout error; the cell ended by itself.
        assert reply.status == "error"
    finally:
        nb.shutdown()


def test_a_sleeping_rank_and_a_barrier_then_why_after_the_interrupt(nb2: NotebookKernel) -> None:
    msg_id = nb2.send("%%distributed\nimport time, torch.distributed as dist\nprint('in', flush=True)\n"
                      "if rank == 1:\n    time.sleep(60)\nelse:\n    dist.barrier()\n")
    nb2.wait_for_output(msg_id, NOTICE, timeout=40)
    nb2.km.interrupt_kernel()  # Kernel > Interrupt: rank 1 leaves its sleep, rank 0 stays in C++
    reply = nb2.collect(msg_id, timeout=60)
    live = notice_of(reply.text)
    assert len(live) == 1
    assert re.fullmatch(r"barrier #2 \(default group\): rank 0 waits in it; rank 1 never called it "
                        r"and is at Cell In\[\d+\], line 4 in <module>", live[0]), live[0]
    # The report of the rank the interrupt did not free does not repeat the live notice's verdict
    # (issue 38: said once): each rank's evidence, under a heading; the group was then aborted and
    # formed again (issue 34, tests/integration/test_recover.py).
    text = reply.text.replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert "Why: " not in text and " ".join(text.split()).count(" ".join(live[0].split())) == 1, text
    assert "Where each rank was (the notice above says why):" in text, text
    lines = text.splitlines()
    assert "    barrier #2 (no tensor) group 0: scheduled" in lines, text
    assert "    barrier #1 (no tensor) group 0: completed" in lines, text
    flat = " ".join(text.split())
    assert "rank 0 waited in the collective and was freed" in flat, text
    assert "the group was aborted and formed again" in flat, text

    why = nb2.run("%clorch why")  # the aborted backends' records are no evidence any more
    assert why.status == "ok"
    assert why.text.splitlines()[0] == "no collective is pending: ranks 0-1 are not running a cell", why.text
    assert "---- ranks 0-1 ----" in why.text and "scheduled" not in why.text, why.text

    one = nb2.run("%clorch why --rank 1").text
    assert "---- rank 1 ----" in one and "---- rank 0 ----" not in one
    threads = nb2.run("%clorch why --rank 0 --all-threads").text
    assert re.search(r"^  thread .+:$", threads, re.M), threads
    assert "clorch_repl/" not in threads, threads  # clorch's own frames never, in any thread's stack
    bad = nb2.run("%clorch why --rank 5")
    assert bad.status == "error" and "rank" in bad.text


def test_a_rank_that_dies_while_the_other_waits(nb2: NotebookKernel) -> None:
    reply = nb2.run("%%distributed\nimport os, torch, torch.distributed as dist\n"
                    "if rank == 1:\n    os._exit(3)\ndist.all_reduce(torch.ones(8))\n", timeout=90)
    assert reply.status == "error"
    text = reply.text.replace("\x1b[1m", "").replace("\x1b[0m", "")
    # gloo fails the survivor's all_reduce as soon as the peer's socket closes, so by the time the
    # death is seen nothing is pending; the verdict names the death and what rank 0 was in.
    assert ("Why: rank 1 died (exit code 3); the last collective of rank 0 was all_reduce #2 "
            "(float32[8], default group)" in " ".join(text.split())), text


def test_an_op_mismatch_is_named_live(nb2: NotebookKernel) -> None:
    msg_id = nb2.send("%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(4)\n"
                      "if rank == 0:\n    dist.all_reduce(t)\nelse:\n    dist.broadcast(t, 0)\n")
    nb2.wait_for_output(msg_id, NOTICE, timeout=40)
    nb2.km.interrupt_kernel()
    reply = nb2.collect(msg_id, timeout=60)
    assert notice_of(reply.text) == ["collective #2 (default group): rank 0 called all_reduce(float32[4]), "
                                     "rank 1 called broadcast(float32[4]); ranks 0-1 wait in it"]


def test_computing_and_busy_collectives_get_no_notice() -> None:
    nb = start(2, pg_timeout=60, notice=2)
    try:
        # 6 s without output: first many small collectives, each finishing, then pure Python work.
        reply = nb.run("%%distributed\nimport time, torch, torch.distributed as dist\n"
                       "end = time.monotonic() + 3\nn = 0\n"
                       "while True:\n"
                       "    n += 1\n"
                       + until_agreed("time.monotonic() >= end", " " * 4) +
                       "end = time.monotonic() + 3\n"
                       "while time.monotonic() < end:\n    sum(range(1000))\n"
                       "print('done', n > 10)\n", timeout=90)
        assert reply.status == "ok", reply.text
        assert "done True" in reply.text
        assert NOTICE not in reply.text
        why = nb.run("%clorch why").text
        assert why.startswith("no collective is pending: ranks 0-1 are not running a cell"), why
    finally:
        nb.shutdown()


def test_a_quiet_loop_is_not_asked_for_its_whole_flight_record_every_check() -> None:
    """The notice's periodic check first asks the ranks for their groups' status only; a rank's
    whole flight record (2,000 entries with their stacks: 20-30 ms of its CPU, GIL held) is read
    only while its collectives stand still. A training loop that prints nothing for minutes
    used to pay that every few seconds."""
    nb = start(2, pg_timeout=60, notice=2)
    try:
        reply = nb.run("%%distributed\nimport time, torch, torch.distributed as dist\n"
                       "from clorch_repl.diagnosis import record\n"
                       "calls, read = [], record.read\n"
                       "def counted(collectives=True):\n"
                       "    calls.append(collectives)\n"
                       "    return read(collectives)\n"
                       "record.read = counted\n"
                       "try:\n"
                       "    end = time.monotonic() + 7\n"
                       "    while True:\n"
                       + until_agreed("time.monotonic() >= end", " " * 8) +
                       "finally:\n"
                       "    record.read = read\n"
                       "print('whole', calls.count(True), 'status', calls.count(False))\n", timeout=90)
        assert reply.status == "ok", reply.text
        assert NOTICE not in reply.text
        counts = re.findall(r"whole (\d+) status (\d+)", reply.text)
        assert counts, reply.text  # one line per rank, or one "[ranks 0-1]" line where they agree
        for whole, status in counts:
            assert int(status) >= 3, reply.text  # checked every second after 2 s of quiet
            assert int(whole) <= 1, reply.text  # at most the first check, which saw one pending
    finally:
        nb.shutdown()


def test_a_stuck_collective_is_named_while_another_group_keeps_moving() -> None:
    """The check's light question compares each group's progress on its own: both ranks keep a
    second group busy (a loop on ``new_group``; a thread's collectives would do the same) while
    rank 0 alone waits in an all_reduce of the default group, which a comparison of the ranks'
    whole status would have taken for progress (an independent review's reproduction)."""
    nb = start(2, pg_timeout=60, notice=2)
    try:
        reply = nb.run("%%distributed\nimport time, torch, torch.distributed as dist\n"
                       "sub = dist.new_group([0, 1])\n"
                       "start, stuck = time.monotonic(), None\n"
                       "while True:\n"
                       + until_agreed("time.monotonic() >= start + 12", " " * 4, group="sub") +
                       "    time.sleep(0.05)\n"
                       "    if rank == 0 and stuck is None and time.monotonic() > start + 4:\n"
                       "        stuck = dist.all_reduce(torch.ones(4), async_op=True)  # rank 1 never calls it\n"
                       "print('loop done')\n", timeout=90)
        assert reply.status == "ok", reply.text
        notice = the_notice(reply)
        assert notice.startswith("all_reduce #2 (float32[4], default group): rank 0 waits in it; "
                                 "rank 1 never called it"), notice
    finally:
        nb.shutdown()


def test_a_stuck_collective_is_named_while_a_thread_floods_another_group() -> None:
    """A rank's answer keeps the last entries of each group, not of the whole recorder: a thread
    running a second group's collectives every few milliseconds used to push the main thread's
    pending all_reduce out of the answer within a second, and the check said nothing was
    pending (a new user's try-out)."""
    nb = start(2, pg_timeout=60, notice=2)
    try:
        reply = nb.run("%%distributed\nimport threading, time, torch, torch.distributed as dist\n"
                       "g = dist.new_group([0, 1])\n"
                       "stop = False\n"
                       "def flood():\n"
                       "    while True:\n"
                       + until_agreed("stop", " " * 8, group="g", leave="return") +
                       "        time.sleep(0.005)\n"
                       "thread = threading.Thread(target=flood)\n"
                       "thread.start()\n"
                       "if rank == 1:\n"
                       "    time.sleep(8)  # late: rank 0 waits alone meanwhile\n"
                       "dist.all_reduce(torch.ones(4))\n"
                       "stop = True\n"
                       "thread.join()\n"
                       "print('done')\n", timeout=90)
        assert reply.status == "ok", reply.text
        notice = the_notice(reply)
        assert re.match(r"all_reduce #\d+ \(float32\[4\], default group\): rank 0 waits in it; "
                        r"rank 1 never called it", notice), notice
    finally:
        nb.shutdown()


def test_hang_notice_zero_is_off_and_a_timeout_report_carries_the_verdict(nb2: NotebookKernel) -> None:
    reply = nb2.run("%%distributed --hang-notice 0 --timeout 6\nimport time, torch.distributed as dist\n"
                    "if rank == 1:\n    time.sleep(30)\nelse:\n    dist.barrier()\n", timeout=90)
    assert reply.status == "error"
    assert NOTICE not in reply.text  # the session's 3 s notice is off for this cell
    text = reply.text.replace("\x1b[1m", "").replace("\x1b[0m", "")
    # the interrupt's grace is said: why a cell with --timeout 6 ends seconds after that
    assert "Timed out after 6 s; the ranks were interrupted and given 5 s more to return." in text, text
    assert said(text, "Why: ")[0].startswith(
        "barrier #2 (default group): rank 0 waits in it; rank 1 never called it and is at Cell In["), text
    assert said(text, "Why: ")[0].endswith("], line 3 in <module>"), text


def test_clorch_interrupt_on_stuck_ranks_says_why(nb2: NotebookKernel) -> None:
    # rank 1 ignores SIGINT in its sleep; rank 0 waits for it in a barrier. Both outlive interrupts.
    msg_id = nb2.send("%%distributed --hang-notice 0\nimport signal, time, torch.distributed as dist\n"
                      "print('in', flush=True)\n"
                      "if rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(60)\n"
                      "dist.barrier()\n")
    nb2.wait_for_ranks(msg_id, "in")
    time.sleep(1.0)  # rank 0 reaches the barrier, rank 1 its sleep
    nb2.km.interrupt_kernel()
    nb2.collect(msg_id, timeout=60)
    again = nb2.run("%clorch interrupt")
    assert again.status == "error" and "ranks 0-1 are stuck: run %clorch restart" in again.text, again.text
    assert re.fullmatch(r"barrier #2 \(default group\): rank 0 waits in it; rank 1 never called it and "
                        r"is at Cell In\[\d+\], line 5 in <module> \(%clorch why shows each rank's collectives\)",
                        said(again.text, "clorch: why: ")[0]), again.text


def test_a_rank_holding_the_gil_is_named_from_its_faulthandler_stack(nb2: NotebookKernel) -> None:
    # rank 1 sits in a C call that keeps the GIL (ctypes.PyDLL does not release it), so its control
    # thread cannot answer; its stack comes from faulthandler (a C-level signal handler) instead.
    reply = nb2.run("%%distributed\nimport ctypes, torch.distributed as dist\n"
                    "if rank == 1:\n    ctypes.PyDLL(None).sleep(14)\n"
                    "dist.barrier()\nprint('through')\n", timeout=120)
    assert reply.status == "ok", reply.text  # the notice does not stop the cell
    assert "through" in reply.text
    [notice] = notice_of(reply.text)
    # faulthandler names the cell's file (/tmp/ipykernel_PID/HASH.py); the notebook names it as it shows it
    assert re.fullmatch(r'barrier #2 \(default group\): rank 0 waits in it; rank 1 did not answer \(native code is '
                        rf'holding its Python lock\); it is at Cell In\[{reply.execution_count}\], line 3 in <module>',
                        notice), notice
