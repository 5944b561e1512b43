"""clorch_repl inside a real notebook kernel, driven through jupyter_client as JupyterLab drives it:
Kernel > Interrupt, a rank stuck in a collective, and the notebook kernel killed outright."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time
from typing import Iterator

import pytest

from clorch_repl.common.procs import pid_running, wait_gone

from notebook_kernel import NotebookKernel, clorch_session
from rank_text import lines_of

PIDS = ("from clorch_repl.magics import magics_for\n"
        "print('PIDS', *magics_for(get_ipython()).session.pids())")


@pytest.fixture()
def nb() -> Iterator[NotebookKernel]:
    with clorch_session("--nproc 2", stop=False) as kernel:  # tests kill the notebook or stop it themselves
        assert kernel.start_reply is not None and "ranks ready 2/2" in kernel.start_reply.text
        yield kernel


@pytest.fixture()
def nb_keeping_logs() -> Iterator[NotebookKernel]:
    """``nb`` with the rank logs kept at the end, as by default (tests/conftest.py turns it off);
    the tests that use it remove what was kept."""
    with clorch_session("--nproc 2", stop=False, env={"CLORCH_KEEP_LOGS": "1"}) as kernel:
        yield kernel


def rank_pids(nb: NotebookKernel) -> list[int]:
    reply = nb.run(PIDS)
    line = next(l for l in reply.text.splitlines() if l.startswith("PIDS"))
    return [int(p) for p in line.split()[1:]]


def test_kernel_interrupt_interrupts_every_rank(nb: NotebookKernel) -> None:
    msg_id = nb.send("%%distributed\nprint('spinning', flush=True)\nwhile True:\n    pass")
    nb.wait_for_ranks(msg_id, "spinning")  # both ranks are in the loop
    nb.km.interrupt_kernel()  # what Kernel > Interrupt does
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "error"
    # each rank's line once (one merged line when they printed it within MERGE_HOLD_S of each other)
    assert all(lines_of(reply.text, r).count("spinning") == 1 for r in (0, 1)), reply.text
    # identical KeyboardInterrupt tracebacks are shown once; if the ranks stopped on different
    # lines of the loop, each rank's own
    assert "---- ranks 0-1 ----" in reply.text or all(f"---- rank {r} ----" in reply.text for r in (0, 1))
    assert "KeyboardInterrupt" in reply.text
    after = nb.run("%%distributed\nprint('back', rank)")
    assert after.status == "ok" and "[rank 1] back 1" in after.text


def test_a_rank_that_ignores_the_interrupt_is_named_with_its_stack(nb: NotebookKernel) -> None:
    # rank 1 ignores SIGINT and sleeps; rank 0 waits for it in a barrier, blocked in C++.
    code = ("%%distributed\nimport signal, time, torch.distributed as dist\n"
            "print('in', flush=True)\n"
            "if rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(600)\n"
            "dist.barrier()")
    msg_id = nb.send(code)
    nb.wait_for_ranks(msg_id, "in")
    time.sleep(0.5)  # rank 0 reaches the barrier, rank 1 its sleep
    nb.km.interrupt_kernel()
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "error"
    # one block for both: the verdict's evidence above already shows where each one is
    assert "ranks 0-1 did not return" in reply.text, reply.text
    # rank 1 is the one to restart: rank 0 only waits for it in the barrier
    assert "%clorch restart --ranks 1 starts it afresh" in " ".join(reply.text.split()), reply.text
    assert "barrier" in reply.text  # rank 0's stack shows where it waits
    assert "kernelbase.py" not in reply.text  # the cell's frames only
    # each rank's stack once (issue 38: the evidence's, not faulthandler's dump again), the cell's
    # file named as the notebook shows the cell
    cell = f"Cell In[{reply.execution_count}]"
    assert f"{cell}, line 5 in <module>" in reply.text  # rank 1 is at its sleep, line 5 of the cell
    assert f"{cell}, line 6 in <module>" in reply.text  # rank 0 is at its barrier, line 6
    assert 'File "' not in reply.text and reply.text.count("dist.barrier()") == 1, reply.text
    assert "ipykernel_" not in reply.text and "clorch_cells_" not in reply.text  # the cell files named as cells
    assert "%clorch restart" in reply.text
    busy = nb.run("%%distributed\nprint('queued?')")
    assert busy.status == "error" and "still running an earlier cell" in busy.text
    status = nb.run("%clorch status")
    assert "busy" in status.text
    again = nb.run("%clorch interrupt")  # rank 1 still ignores SIGINT: named again, with its stack
    assert again.status == "error"
    assert "rank 1 did not return after the interrupt" in again.text and "ranks 0-1 are stuck" in again.text
    restarted = nb.run("%clorch restart")
    assert restarted.status == "ok", restarted.text
    ok = nb.run("%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
                "dist.all_reduce(t)\nprint('sum', t.item())")
    assert ok.status == "ok" and "[ranks 0-1] sum 2.0" in ok.text


def test_sigkill_of_the_notebook_kernel_leaves_no_rank_behind(nb_keeping_logs: NotebookKernel) -> None:
    nb = nb_keeping_logs
    pids = rank_pids(nb)
    session_dir = nb.run("print('DIR', magics_for(get_ipython()).session.group.dir)").text.split("DIR ")[1].strip()
    assert len(pids) == 2 and all(pid_running(p) for p in pids) and os.path.isdir(session_dir)
    os.kill(nb.pid, signal.SIGKILL)
    assert wait_gone(pids, 10) == [], "ranks outlived the notebook kernel"
    deadline = time.monotonic() + 5  # the supervisors remove it right after ending their ranks
    while os.path.exists(session_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(session_dir), "the session's directory was left behind"
    # the rank logs outlive the crash, beside where the session's files were, and nothing else does
    kept = session_dir + "-logs"
    try:
        assert sorted(os.listdir(kept)) == ["rank0.log", "rank1.log"]
        assert stat.S_IMODE(os.stat(kept).st_mode) == 0o700
        with open(os.path.join(kept, "rank1.log")) as fh:
            assert "--- clorch_repl: rank 1 starting at" in fh.read()
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_stop_ends_every_rank_and_keeps_their_logs(nb_keeping_logs: NotebookKernel) -> None:
    nb = nb_keeping_logs
    pids = rank_pids(nb)
    coloured = nb.run("%%distributed\nprint('\\x1b[31mred\\x1b[0m on', rank)")
    assert coloured.status == "ok", coloured.text
    shown = nb.run("%clorch logs 1").text  # the log holds the colour codes; %clorch logs shows text
    assert "red on 1" in shown and "\x1b[" not in shown, repr(shown)
    reply = nb.run("%clorch stop")
    assert reply.status == "ok" and "stopped 2 rank(s); their logs are kept in " in reply.text, reply.text
    assert wait_gone(pids, 5) == []
    kept = reply.text.split("their logs are kept in ")[1].split()[0]
    try:
        assert sorted(os.listdir(kept)) == ["rank0.log", "rank1.log"]  # the logs only: no key, socket or store
        with open(os.path.join(kept, "rank1.log")) as fh:
            assert "\x1b[31mred\x1b[0m on 1" in fh.read()  # the file is as the rank wrote it
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_reloading_the_extension_says_that_it_stopped_the_ranks(nb_keeping_logs: NotebookKernel) -> None:
    """``%reload_ext`` is a habit; it unloads the extension, which ends the ranks and their
    variables. That must be said, with where the logs went, not found out at the next cell."""
    nb = nb_keeping_logs
    pids = rank_pids(nb)
    reply = nb.run("%reload_ext clorch_repl")
    assert reply.status == "ok", reply.text
    assert ("clorch: the extension was unloaded: stopped the session's 2 rank(s); their variables are gone, "
            "their logs are kept in ") in reply.text, reply.text
    assert wait_gone(pids, 5) == []
    shutil.rmtree(reply.text.split("their logs are kept in ")[1].split()[0], ignore_errors=True)
    again = nb.run("%clorch status")  # loaded again, with no session
    assert again.status == "ok" and "no ranks are running" in again.text, again.text
    quiet = nb.run("%unload_ext clorch_repl")  # nothing ran: nothing to say
    assert quiet.status == "ok" and "clorch:" not in quiet.text, quiet.text
