"""Which magic call gets the cell the head start sent (clorch_repl.magics.head_start.HeadStart.claim),
and what reading a line keeps alive (clorch_repl.magics.cell_options).

No process here: the kernel below stands in for ipykernel only in what ``claim`` asks of it, the
parent of the request the notebook kernel is running now (``get_parent("shell")``); what the
head start sends, and how a real kernel runs it, is tests/integration/test_head_start.py's.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

from clorch_repl.magics.cell_options import cell_options
from clorch_repl.magics.core import ClorchMagics
from clorch_repl.magics.head_start import HeadStart, _Pending


class _RunningRequest:
    """Stands in for the notebook's ipykernel: the request it is running (no kernel in a unit test)."""

    def __init__(self, msg_id: str) -> None:
        self.msg_id = msg_id

    def get_parent(self, channel: str) -> dict[str, Any]:
        assert channel == "shell"
        return {"header": {"msg_id": self.msg_id}}


def _head_start(running: str, sent_for: str) -> tuple[HeadStart, object]:
    head = HeadStart(magics=None)  # type: ignore[arg-type]  # claim reads no magics
    head._kernel = _RunningRequest(running)
    started = object()  # what claim hands back: the relay's StartedCell, opaque to it
    head._pending = _Pending(sent_for, "--ranks 0", "print(1)\n", 7, started)  # type: ignore[arg-type]
    return head, started


def test_the_magic_of_the_request_the_cell_was_sent_for_claims_it_once() -> None:
    head, started = _head_start("req-1", "req-1")
    assert head.claim("--ranks 0", "print(1)\n", 7) is started
    assert head.claim("--ranks 0", "print(1)\n", 7) is None  # claimed: the next call sends its own


def test_a_magic_call_of_another_request_leaves_the_cell_to_its_own() -> None:
    # a %%distributed run by another request (a subshell's cell, a comm handler) while the head
    # start's cell waits for its magic: that call must not take it, and its own magic still can
    head, started = _head_start("other-request", "req-1")
    assert head.claim("--ranks 0", "print(1)\n", 7) is None
    head._kernel.msg_id = "req-1"
    assert head.claim("--ranks 0", "print(1)\n", 7) is started


class _Magics:
    """Holds the real %%distributed magic's function (its parser is the function's), without a shell."""

    distributed = ClorchMagics.distributed


def test_a_line_read_once_is_read_from_memory_and_keeps_no_magics_instance_alive() -> None:
    magics = _Magics()
    first = cell_options(magics.distributed, "--ranks 0,1 --timeout 5")
    assert first is not None and first.ranks == (0, 1) and first.timeout_s == 5
    assert cell_options(_Magics().distributed, "--ranks 0,1 --timeout 5") is first  # memoised per function
    gone = weakref.ref(magics)
    del magics
    gc.collect()
    assert gone() is None  # an unloaded extension's ClorchMagics is not held by the memo
