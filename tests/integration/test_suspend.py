"""Suspend on CPU ranks (issue 37), in a real notebook kernel driving real gloo ranks: there is no
GPU to give back, so ``%clorch suspend`` is refused with its reason and the session works on; the
idle suspend of ``--suspend-after`` fires on the kernel's event loop between cells, and what it did
(here: the same refusal) is said at the start of the next cell. The suspend itself, on a GPU:
tests/gpu/test_gpu_suspend.py."""

from __future__ import annotations

import time

import pytest

from notebook_kernel import CPU_RANKS, clorch_session
from rank_text import lines_of

pytestmark = pytest.mark.slow


def test_cpu_ranks_refuse_suspend_and_keep_working() -> None:
    with clorch_session(CPU_RANKS + " --suspend-after 3") as nb:
        assert "suspends by itself once no cell has run for 3s" in nb.start_reply.text, nb.start_reply.text
        setup = nb.run("%%distributed\nimport torch, torch.distributed as dist\nx = torch.arange(4.) + rank\n")
        assert setup.status == "ok", setup.text

        refused = nb.run("%clorch suspend")
        assert refused.status == "error"
        assert "cannot suspend: the ranks run on CPUs (gloo): they hold no GPU to give back" in refused.text, \
            refused.text
        resumed = nb.run("%clorch resume")
        assert resumed.status == "error" and "nothing to resume: the session is ready" in resumed.text, resumed.text

        time.sleep(6)  # no cell: the idle timer fires on the kernel's loop and is refused the same way
        after = nb.run("%%distributed\nt = x.clone()\ndist.all_reduce(t)\nprint(t.tolist())\n")
        assert after.status == "ok", after.text
        assert "clorch: no cell ran for" in after.text and "but the session could not be suspended: cannot " \
            "suspend: the ranks run on CPUs" in after.text, after.text
        assert lines_of(after.text, 0) == ["[1.0, 3.0, 5.0, 7.0]"], after.text

        off = nb.run("%clorch suspend --after 0")
        assert off.status == "ok" and "will not suspend by itself" in off.text, off.text
        status = nb.run("%clorch status")
        assert status.status == "ok" and "suspended" not in status.text, status.text
