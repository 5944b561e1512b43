"""What a session shows of its ranks on request: where they are (``why``), a rank's log
(``logs``), JupyterLab's debugger panel pointed at one rank (``debug_rank``).

Why apart from :mod:`.session`: the session module holds the session's life and its cells; these
are questions about the ranks, and their refusals name the user's next step in the words of
whoever drives the session (``self.hooks.verbs``, :class:`~clorch_repl.session.hooks.Verbs`:
``session.why()`` for a script, ``%clorch why`` in the notebook). :class:`Inspecting` is a part of
:class:`~clorch_repl.session.session.Session` (a base class), as :class:`~.suspend.Suspending` is.
"""

from __future__ import annotations

import logging
from typing import Any

from ..common.topology import check_unique_in_range
from ..errors import ConfigError
from .hooks import Verbs
from .suspend import refuse_cell

logger = logging.getLogger(__name__)


class Inspecting:
    """:meth:`why`, :meth:`logs` and :meth:`debug_rank` of a :class:`~clorch_repl.session.session.Session`."""

    #: the folder where the last :meth:`stop` kept the ranks' logs ("" before any stop kept them)
    kept_logs: str = ""

    def debug_rank(self: Any, rank: int | None) -> None:
        """Forward the notebook kernel's debug_request (JupyterLab's debugger) to ``rank``, or,
        with None, let the notebook kernel answer them itself again (the hooks' ``debugger``)."""
        if rank is not None:  # checked before anything changes
            group, relay = self._require()
            check_unique_in_range([rank], self.topology.nproc, self.hooks.verbs.debugger, "rank")
        if self.debugger is not None:
            self.debugger.uninstall()
            self.debugger = None
            if self.relay is not None:
                self.relay.set_debug_sink(None)
        if rank is not None:
            self.debugger = self.hooks.debugger(group.ranks[rank], rank)
            relay.set_debug_sink(self.debugger.event)

    def why(self: Any, ranks: list[int] | None = None, *, all_threads: bool = False) -> str:
        """Where every rank is and the first collective they disagree on (``%clorch why``):
        the verdict, then ``ranks``' evidence (every rank's by default)."""
        _, relay = self._require()
        verbs = self.hooks.verbs
        refuse_cell(self.life, f"then {verbs.why}", verbs)  # a suspended rank's answer would wait for the resume
        if ranks is not None:
            check_unique_in_range(ranks, self.topology.nproc, verbs.why_ranks, "rank")
        return relay.why(ranks, all_threads=all_threads)  # every rank asked, ``ranks``' evidence shown

    def logs(self: Any, rank: int, tail: int | None = None) -> str:
        """The last ``tail`` lines rank ``rank`` wrote (all of them with None or 0, as ``%clorch logs
        --tail 0``), earlier kernels of the rank (before a restart) included; once the session is
        stopped, what its stop kept of them, under a line saying so (as ``%clorch logs`` after
        ``%clorch stop``)."""
        stopped = self.group is None and self.kept_logs
        group = None if stopped else self._require()[0]
        check_unique_in_range([rank], self.topology.nproc, self.hooks.verbs.logs, "rank")
        tail = _checked_tail(tail)
        return kept_log_text(self.kept_logs, rank, tail, self.hooks.verbs) if group is None else group.log_tail(rank, tail)


def _checked_tail(tail: int | None) -> int | None:
    """``logs``' ``tail``: None for everything (0 or None), else the number of lines; refused
    unless a whole number, 0 or more."""
    if tail is not None and (isinstance(tail, bool) or not isinstance(tail, int) or tail < 0):
        raise ConfigError(f"tail must be a whole number of lines, 0 (everything) or more; got {tail!r}")
    return tail or None


def kept_log_text(kept: str, rank: int, tail: int | None, verbs: Verbs) -> str:
    """Rank ``rank``'s log (its last ``tail`` lines; None: all) in ``kept``, where a stop kept a
    session's logs (:mod:`clorch_repl.host.logfiles`), under a line saying so; a ConfigError
    naming the next step where that folder holds no log of the rank."""
    from ..host.logfiles import kept_log

    try:
        path, text = kept_log(kept, rank, tail)
    except FileNotFoundError as exc:
        raise ConfigError(f"no ranks are running, and {exc}: {verbs.to_start} first") from None
    return f"clorch: no ranks are running; rank {rank}'s log as the last {verbs.stop} kept it ({path}):\n{text}"
