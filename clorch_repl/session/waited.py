"""The cell a relay waits for, and the one thing another thread may do to it: interrupt it.

Why a room of its own: the relay's ZeroMQ sockets and its ledger belong to the thread that
started the session (in the notebook, the kernel's main thread). ZeroMQ sockets are not
thread-safe and the ledger holds no lock, so another thread (a script's watchdog, a timer, an
agent's handler, a notebook subshell) may never read or send on them. What it may do depends on
the instant: while a cell is waited for, it asks the waiting loop (a flag read on every pass,
which interrupts the ranks on its own thread); while none is, it may only send the ranks their
signals (the launcher's ``interrupt``: a signal, or a message queued for a nanny's own thread).
The question "is a cell waited for" and the answer are taken under one lock with the places that
set and clear the waited-for cell: without it a flag set for a cell that had just ended was read
by no one, the helper thread went on to drain the sockets itself, and the session wedged
(every later cell refused as "still running an earlier cell", the review's ex6).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from .cell_request import StartedCell
from .cell_run import CellRun
from .sink import OutputSink, PlainSink
from .stdin import StdinBroker

logger = logging.getLogger(__name__)


class WaitedCell:
    """The cell begun and not yet finished (see the module docstring); set and cleared by the
    relay's owner thread, asked to interrupt from any."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: the thread that owns the sockets and the ledger (the one that made the relay)
        self.owner = threading.get_ident()
        self.run: CellRun | None = None
        self.stdin: StdinBroker | None = None
        self.sink: OutputSink = PlainSink()
        self.started: StartedCell | None = None
        self._interrupt = False

    def owned_here(self) -> bool:
        """Whether the calling thread may use the relay's sockets and ledger."""
        return threading.get_ident() == self.owner

    def begin(self, started: StartedCell) -> None:
        """``started`` is now the cell waited for (an interrupt asked of an earlier one is forgotten)."""
        with self._lock:
            self.run, self.stdin, self.started = started.run, started.stdin, started
            self._interrupt = False

    def end(self) -> None:
        """No cell is waited for any more."""
        with self._lock:
            self.run, self.stdin, self.started, self.sink = None, None, None, PlainSink()

    def ask_interrupt(self, otherwise: Callable[[], None] | None = None) -> bool:
        """From any thread: while a cell is waited for, ask its loop to interrupt it (True);
        otherwise call ``otherwise`` (the ranks' signals: no socket, no ledger), under the same
        lock, so that no cell begins meanwhile, and return False."""
        with self._lock:
            if self.run is not None:
                self._interrupt = True
                return True
            if otherwise is not None:
                otherwise()
            return False

    def take_interrupt(self) -> bool:
        """For the waiting loop: whether an interrupt was asked since the last look."""
        with self._lock:
            asked, self._interrupt = self._interrupt, False
            return asked
