"""The one contract between a running cell and what shows its output (the output-sink protocol).

Why one contract: the relay used to name only ``output`` and ``flush`` in its protocol and reach
``comm`` and ``notice`` through ``getattr``, so a sink written to the protocol silently lost the
ordering of widgets and the hang notice. Every method the relay calls is named here, as
jupyter_client's ``execute_interactive`` hooks (``output_hook``, ``stdin_hook``) are one contract.
:class:`PlainSink` gives the behaviour a sink without an opinion wants (widget messages delivered
at once, the hang notice as a warning); :class:`~clorch_repl.notebook.display.NotebookDisplay` is
the notebook's sink.

Every method is called on the thread that runs the cell (the one that called ``Session.run`` or
``finish``). One that raises ends the cell's wait there: the cell is abandoned as a timed-out
one is (it runs on to its end on the ranks; its later output is dropped and counted, never
given to the next cell's sink) and the exception leaves ``run``; a KeyboardInterrupt interrupts
the cell instead, as Ctrl-C does (see :mod:`clorch_repl.session.hooks`).
"""

from __future__ import annotations

import logging
import warnings
from typing import Callable, Protocol, runtime_checkable

from .protocol import RankOutput

logger = logging.getLogger(__name__)


@runtime_checkable
class OutputSink(Protocol):
    """Where a cell's output goes as it arrives (the notebook display, or a test's list)."""

    def output(self, item: RankOutput) -> None:
        """One piece of a rank's output, in the rank's order."""

    def flush(self, final: bool = False) -> None:
        """Called after each burst of messages, and with ``final`` once the cell has ended (and
        before a rank's prompt opens, so that what the rank printed first is shown first)."""

    def comm(self, rank: int, deliver: Callable[[], None]) -> None:
        """A rank's comm message (a widget's); ``deliver`` republishes it. A sink that orders
        output calls it in the rank's order with the rank's output (see clorch_repl.notebook.comms)."""

    def notice(self, text: str) -> None:
        """A message of clorch_repl's own into the running cell (the hang notice)."""


class PlainSink:
    """A complete sink that keeps nothing: a base for sinks that only care about ``output``."""

    def output(self, item: RankOutput) -> None:
        pass

    def flush(self, final: bool = False) -> None:
        pass

    def comm(self, rank: int, deliver: Callable[[], None]) -> None:
        deliver()  # nothing to keep in order with: at once

    def notice(self, text: str) -> None:
        warnings.warn(text, RuntimeWarning, stacklevel=3)


#: sink classes found complete (a runtime Protocol check costs tens of microseconds a cell)
_COMPLETE_SINKS: set[type] = set()


def complete_sink(sink: OutputSink | None) -> OutputSink:
    """``sink``, or a PlainSink for None; refused when it lacks a part of the contract (a
    missing comm() would lose a widget message mid-cell)."""
    if sink is None:
        return PlainSink()
    if type(sink) not in _COMPLETE_SINKS:
        if not isinstance(sink, OutputSink):
            raise TypeError(f"{type(sink).__name__} is not a complete output sink: it needs output, flush, comm "
                            "and notice (clorch_repl.session.sink.OutputSink; PlainSink gives defaults)")
        _COMPLETE_SINKS.add(type(sink))
    return sink
