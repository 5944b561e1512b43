"""The engine's public face: a session of ranks driven from plain Python, without IPython (issue 33).

What the notebook's magics, ``clorch-release-check``, scripts and agents use alike::

    from clorch_repl.session.engine import CellHooks, local_session

    class Show(CellHooks):
        def output(self, item):                      # each piece of a rank's output, in its order
            print(item.rank, item.kind, item.content)
        def answer(self, rank, prompt, password):    # a rank's input(); raise EOFError for end-of-file
            return "42"

    session = local_session(nproc=2, backend="gloo")
    session.start()                                  # the ranks' kernels, and their process group
    outcome = session.run("print(rank, input('n? '))", None, None, Show())
    outcome.ok, session.view().state                 # how each rank ended; the session's state
    session.interrupt()                              # KeyboardInterrupt on every rank
    session.stop()                                   # no process left behind: what survived, if anything

The verbs are :class:`~clorch_repl.session.session.Session`'s: ``start``, ``run`` (or ``begin``
then ``finish``), ``interrupt``, ``view`` and ``status``, ``stop``; the hooks' contract is
:mod:`clorch_repl.session.hooks`.

Threads: a session belongs to the thread that started it, which calls every method, and on which
every hook is called (its ZeroMQ sockets and its book of the ranks' requests are not locked).
``interrupt`` alone is safe from any other thread (a watchdog, a timer, a signal handler's
helper): it interrupts the cell being waited for, or, with none, sends the ranks their
KeyboardInterrupt and returns at once (see :mod:`clorch_repl.session.waited`).

The notebook's implementation of the hooks is
:mod:`clorch_repl.notebook`.
"""

from __future__ import annotations

import logging
from typing import Iterable

from ..common.topology import resolve_topology
from ..errors import TopologyError
from .hooks import CellHooks, NoStdin, OutputSink, PlainSink, SessionHooks, StdinHook
from .protocol import CellOutcome, RankOutcome, RankOutput, Status
from .session import Session

logger = logging.getLogger(__name__)

__all__ = ["CellHooks", "CellOutcome", "NoStdin", "OutputSink", "PlainSink", "RankOutcome", "RankOutput", "Session",
           "SessionHooks", "StdinHook", "Status", "local_session"]


def local_session(nproc: int | None = None, backend: str | None = None, devices: str | Iterable[int] | None = None,
                  timeout_s: float | str | None = None, *, hooks: SessionHooks | None = None) -> Session:
    """A session of ``nproc`` ranks on this host, not yet started (``start()`` starts it), as
    ``%clorch start`` makes one: every visible GPU with nccl by default, or 2 CPU ranks with gloo
    without a GPU; ``timeout_s``: the process group's timeout. ``hooks``: what the driving
    process offers between cells (none by default: plain Python)."""
    try:
        topology = resolve_topology(nproc, devices, backend, timeout_s)
    except TopologyError as exc:  # said with this function's own parameter names
        raise exc.naming(timeout="timeout_s", limit="a cell's own time limit is Session.run's timeout_s") from None
    return Session(topology, hooks=hooks)
