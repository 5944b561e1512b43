"""Kernel > Interrupt pressed twice while the first interrupt is still asking the ranks where they
are: the second must end the cell at once, as the rank's report, never as a KeyboardInterrupt
escaping from inside clorch_repl (which left the ranks uninterrupted and the session wedged)."""

from __future__ import annotations

import re

import time
from typing import Iterator

import pytest

from notebook_kernel import NotebookKernel, clorch_session

# A regular expression that backtracks for hours: CPython's re engine holds the GIL throughout,
# so this rank can neither answer the probe (its control thread never runs) nor see SIGINT.
HOLD_GIL = "import re\nre.match(r'(a+)+$', 'a' * 64 + 'b')\n"


@pytest.fixture()
def nb() -> Iterator[NotebookKernel]:
    with clorch_session("--nproc 2 --backend gloo") as kernel:
        yield kernel


def test_second_interrupt_during_the_probe_ends_the_cell_at_once(nb: NotebookKernel) -> None:
    msg_id = nb.send("%%distributed --hang-notice 0\nprint('in', flush=True)\nif rank == 1:\n"
                     + "".join("    " + line + "\n" for line in HOLD_GIL.splitlines())
                     + "else:\n    import time\n    time.sleep(600)\n")
    nb.wait_for_ranks(msg_id, "in")
    time.sleep(0.5)  # rank 1 is inside the match
    nb.km.interrupt_kernel()
    time.sleep(0.3)  # inside the first interrupt's probe, which waits up to 1 s for rank 1
    second = time.monotonic()
    nb.km.interrupt_kernel()
    reply = nb.collect(msg_id, timeout=60)
    took = time.monotonic() - second
    assert reply.status == "error"
    # rank 1 (and rank 0, when its sleep had not ended either: then one block for both, issue 25)
    assert re.search(r"(rank 1|ranks 0-1) had not returned", reply.text) and \
        "when an interrupt from the notebook ended the wait early" in reply.text, reply.text
    assert "within the grace period after being interrupted" not in reply.text  # the grace was cut short
    assert "clorch_repl/session/relay.py" not in reply.text, reply.text  # the rank's report, not ours
    assert took < 10, f"the cell ended {took:.1f} s after the second interrupt"
    # The notebook kernel is usable, and the session knows rank 1 is still busy.
    assert nb.run("1 + 1").status == "ok"
    busy = nb.run("%%distributed\nprint('queued?')")
    assert busy.status == "error" and "still running an earlier cell" in busy.text
    restarted = nb.run("%clorch restart")
    assert restarted.status == "ok", restarted.text
    ok = nb.run("%%distributed\nprint('fresh', rank)")
    assert ok.status == "ok" and "[rank 1] fresh 1" in ok.text
