"""Suspend on CPU ranks (issue 37), in a real notebook kernel driving real gloo ranks: there is no
GPU to give back, so ``%clorch suspend`` is refused with its reason and the session works on, and
an idle suspend (``--suspend-after``, ``suspend --after``) is refused when it is asked for, not
when it would fire (the timer itself: tests/unit/test_suspend_units.py; it fired on CPU ranks only
to be refused). The driver's helper process and a remote rank's nanny run for real and report the
driver's absence. The suspend itself, on a GPU: tests/gpu/test_gpu_suspend.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from notebook_kernel import CPU_RANKS, clorch_session
from rank_text import lines_of

pytestmark = pytest.mark.slow


def test_cpu_ranks_refuse_suspend_and_keep_working() -> None:
    with clorch_session(CPU_RANKS) as nb:
        later = nb.run(f"%clorch stop\n%clorch start {CPU_RANKS} --suspend-after 3")
        assert later.status == "error", later.text  # refused before any rank starts
        assert "--suspend-after cannot work: the ranks run on CPUs (gloo): they hold no GPU" in later.text, later.text
        assert "no ranks are running" in nb.run("%clorch status").text
        assert nb.run(f"%clorch start {CPU_RANKS}").status == "ok"
        setup = nb.run("%%distributed\nimport torch, torch.distributed as dist\nx = torch.arange(4.) + rank\n")
        assert setup.status == "ok", setup.text

        refused = nb.run("%clorch suspend")
        assert refused.status == "error"
        assert "cannot suspend: the ranks run on CPUs (gloo): they hold no GPU to give back" in refused.text, \
            refused.text
        armed = nb.run("%clorch suspend --after 3")
        assert armed.status == "error" and "--after cannot work: the ranks run on CPUs" in armed.text, armed.text
        assert nb.run("%clorch suspend --after 0").status == "ok"  # (nothing armed: nothing to say)
        resumed = nb.run("%clorch resume")
        assert resumed.status == "error" and "nothing to resume: the session is ready" in resumed.text, resumed.text
        assert "%clorch suspend" not in resumed.text and "run on CPUs" in resumed.text, resumed.text  # (refused here)

        after = nb.run("%%distributed\nt = x.clone()\ndist.all_reduce(t)\nprint(t.tolist())\n")
        assert after.status == "ok", after.text
        assert lines_of(after.text, 0) == ["[1.0, 3.0, 5.0, 7.0]"], after.text
        status = nb.run("%clorch status")
        assert status.status == "ok" and "suspended" not in status.text, status.text


def test_the_checkpoint_helper_names_the_rank_and_the_driver_needed_without_one() -> None:
    """The helper the session (and each nanny) runs, for real: on this machine there is no NVIDIA
    driver, so each process's report says which rank, on which host, and what is needed."""
    done = subprocess.run([sys.executable, "-m", "clorch_repl.host.cuda_checkpoint", "suspend", "4242=rank 1 on nodeA"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout.splitlines()[0])
    assert report["pid"] == 4242 and report["ok"] is False
    assert report["error"].startswith("rank 1 on nodeA: ") and "driver 570 or later" in report["error"], report


def test_a_remote_ranks_nanny_runs_the_checkpoint_on_its_host_and_answers() -> None:
    """``--launcher attach`` (real torchrun, real nannies on this host): the notebook asks each
    rank's nanny for the checkpoint, the nanny runs the helper beside its kernel, keeps beating,
    and answers; here each answer is the driver's absence, named with the rank and its host."""
    from test_remote_ranks import attached_session

    with attached_session() as session:
        nb = session.nb
        asked = nb.run("m = get_ipython().magics_manager.registry['ClorchMagics']\n"
                       "replies = m.session.group.checkpoint('suspend', [0, 1], 60)\n"
                       "for r, reply in sorted(replies.items()):\n"
                       "    print(r, reply['outcome']['ok'], reply['outcome']['error'])\n", timeout=120)
        assert asked.status == "ok", asked.text
        lines = [line for line in asked.text.splitlines() if line[:2] in ("0 ", "1 ")]
        assert len(lines) == 2, asked.text
        for r, line in enumerate(lines):
            assert line.startswith(f"{r} False rank {r} on ") and "driver 570 or later" in line, asked.text
        alive = nb.run("%%distributed\nprint(rank)\n")  # the ranks were never touched
        assert alive.status == "ok" and lines_of(alive.text, 1) == ["1"], alive.text


def test_the_session_side_runs_the_helper_and_maps_each_ranks_report() -> None:
    """clorch_repl.session.suspend.drive with a local launcher's ranks: the real helper process,
    its JSON reports read back per rank (no driver here, so each is a named failure)."""
    from types import SimpleNamespace

    from clorch_repl.session import suspend

    launcher = SimpleNamespace(ranks=[SimpleNamespace(rank=0, pid=4242, host=""),
                                      SimpleNamespace(rank=1, pid=4343, host="")],
                               checkpoint=lambda action, ranks, timeout_s: None)  # ranks on this host
    moved = suspend.drive("resume", launcher, [0, 1], 0)  # type: ignore[arg-type]
    assert [m.ok for m in moved.values()] == [False, False]
    assert moved[1].error.startswith("rank 1 on ") and "driver 570 or later" in moved[1].error, moved
