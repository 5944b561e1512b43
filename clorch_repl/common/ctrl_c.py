"""Ctrl-C held back while something must happen whole: a cell sent to its ranks (it goes to all of
them or to none), a rank's output handed over (:mod:`clorch_repl.kernel.output`: text taken from a
stream's buffer and not yet sent would be lost).

Why, for the relay: a cell sent to some ranks and then lost (KeyboardInterrupt between two sends, or between a
send and the note of its message id) would leave those ranks running with nobody reading them,
and the next cell would find them busy. Kernel > Interrupt during the sends is noted, not
raised; once every rank has the cell, the relay then hands back the cell marked interrupted, and
finishing it ends it so (:attr:`clorch_repl.session.relay.StartedCell.interrupted`).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = ["ctrl_c_deferred"]


class _Deferred:
    """Whether a Ctrl-C came during the block."""

    def __init__(self) -> None:
        self.came = False


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[_Deferred]:
    """Ctrl-C (SIGINT as KeyboardInterrupt) during the block is noted, not raised, so that a cell
    goes to every one of its ranks or, if anything else fails, to none that is not interrupted
    again: a cell sent to some ranks and then lost would leave them running with nobody reading
    them. Only on the main thread, and only where SIGINT raises KeyboardInterrupt (ipykernel sets
    that for the length of a request); elsewhere the block runs as it is."""
    deferred = _Deferred()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield deferred
        return

    def note(signum: int, frame: Any) -> None:
        deferred.came = True

    signal.signal(signal.SIGINT, note)
    try:
        yield deferred
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
