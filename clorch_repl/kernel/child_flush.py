"""The timed flush of a forked child's unfinished line (a Pool's or a DataLoader's worker).

A rank's stream in a forked child keeps text that ends no line until the line's end
(:meth:`clorch_repl.kernel.output.RankOutStream._hold_in_child`), so that workers printing at
once do not run into each other's lines. A line that never ends (``print(x, end="")``, a
``"\\r"`` progress update without a flush) must still reach the notebook, and soon: a worker may be
ended without a chance to flush (``with Pool() as p`` terminates its workers). ipykernel's
IOPub thread, which times the flushes of the rank itself, does not survive the fork; one daemon
thread per child, started the first time a line is held, flushes what is held
:data:`HOLD_S` after it was held. Imported in the rank (ipykernel at module level: no).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

#: how long a forked child's unfinished line waits for its end before it is sent as it is
HOLD_S = 0.1


class ChildFlush:
    """Flushes the streams that hold an unfinished line, :data:`HOLD_S` after the first was held.
    One per process: a child that forks again starts its own thread (threads do not survive a
    fork; a lock or condition held at the fork is made afresh)."""

    def __init__(self) -> None:
        self._pid = 0  # the process whose thread this is (0: none started)
        self._cond = threading.Condition()
        self._held: list[Any] = []
        self._due: float | None = None

    def held(self, stream: Any) -> None:
        """``stream`` holds an unfinished line: flush it within :data:`HOLD_S`."""
        if self._pid != os.getpid():
            self._start()
        with self._cond:
            if not any(s is stream for s in self._held):
                self._held.append(stream)
            if self._due is None:
                self._due = time.monotonic() + HOLD_S
                self._cond.notify()

    def _start(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._held, self._due = [], None
        threading.Thread(target=self._run, name="clorch-child-flush", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._due is None or self._due > time.monotonic():
                    self._cond.wait(None if self._due is None else self._due - time.monotonic())
                streams, self._held, self._due = self._held, [], None
            for stream in streams:
                try:
                    stream._flush()  # the send itself, as ipykernel's IOPub thread does it in the rank
                except (OSError, ValueError) as exc:  # the stream or its pipe is gone: nothing to send it to
                    logger.debug("a forked child's held line could not be flushed: %s", exc)


#: the one of this process (see ChildFlush)
CHILD_FLUSH = ChildFlush()
