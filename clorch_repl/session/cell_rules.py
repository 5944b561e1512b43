"""The rules that refuse a cell before any rank is sent anything, and the request that passes them.

Why apart from :mod:`.session`: every way a cell begins (``run``, ``begin``, clorch's own
requests) passes the same rules, and their refusals are the user's next step, named in the words
of whoever drives the session (:class:`~clorch_repl.session.hooks.Verbs`: a script's methods, the
notebook's magics), not the notebook's alone.
"""

from __future__ import annotations

import logging
import operator
import os
from typing import TYPE_CHECKING, Iterable

from ..common.topology import check_unique_in_range, parse_number, parse_timeout
from ..common.rank_sets import rank_words
from ..errors import ClorchError, ConfigError, ranks_are
from ..launchers.base import Launcher
from ..wire.limits import limits_from_env
from .hooks import Verbs
from .lifecycle import Lifecycle, SessionState
from .protocol import CellRequest
from .suspend import refuse_cell

if TYPE_CHECKING:
    from .relay import Relay

logger = logging.getLogger(__name__)


def refuse_dead_or_busy(group: Launcher, relay: Relay, chosen: tuple[int, ...], verbs: Verbs) -> None:
    """Refuse a cell on ``chosen`` ranks when one is dead or still runs an earlier cell. A dead
    rank's refusal offers its restart alone, or, where the launcher cannot replace it (a detached
    session), what the launcher says to do instead (never a command that would be refused)."""
    wanted = set(chosen)
    dead = [group.ranks[r] for r in group.dead(chosen)]
    if dead:
        what = ", ".join(f"{p.where} ({p.exit})" for p in dead)
        if advice := group.instead_of_replacing([p.rank for p in dead]):
            raise ClorchError(f"{what} is dead: {advice}")
        lost = ",".join(str(p.rank) for p in dead)
        raise ClorchError(f"{what} is dead: {verbs.restart_ranks.format(ranks=lost)} starts it afresh while the "
                          f"others keep their variables, or {verbs.restart} starts every rank afresh")
    busy = [r for r in relay.busy() if r in wanted]
    if busy:
        instead = group.instead_of_restarting()  # a detached session refuses the restart
        raise ClorchError(f"{ranks_are(busy)} still running an earlier cell: wait, run {verbs.interrupt}"
                          + (f"; {instead}" if instead else f", or {verbs.restart}"))


def cell_ranks(ranks: Iterable[int], nproc: int, what: str, *, empty: bool = False) -> tuple[int, ...]:
    """The ranks a cell was given (a list of rank numbers), checked as ``%%distributed --ranks``
    checks its own (:func:`~clorch_repl.common.topology.check_unique_in_range`) and named ``what``
    (the option as its user writes it: :class:`~clorch_repl.session.hooks.Verbs`); refused with one
    line before any rank is sent anything. ``empty``: no rank is a choice too (``stdin_ranks=[]``:
    no rank may ask for input)."""
    wrong = ConfigError(f"{what} must be a list of rank numbers, e.g. [0, 1] (None: every rank); got {ranks!r}")
    if isinstance(ranks, (str, bytes)):  # (a rank number is no character)
        raise wrong
    try:
        given = list(ranks)
    except TypeError:
        raise wrong from None
    if any(isinstance(r, bool) or not hasattr(r, "__index__") for r in given):  # (True is no rank)
        raise wrong
    chosen = tuple(operator.index(r) for r in given)
    if not chosen and not empty:
        raise ConfigError(f"{what} names no rank: name at least one (None: every rank)")
    check_unique_in_range(chosen, nproc, what, "rank")
    return chosen


def cell_request(code: str, chosen: tuple[int, ...], timeout_s: float | None, *, group: Launcher, relay: Relay,
                 life: Lifecycle, nproc: int, hang_notice_s: float, verbs: Verbs, silent: bool = False,
                 stdin_ranks: list[int] | None = None, cell_number: int | None = None) -> CellRequest:
    """The request for a cell on ``chosen`` (checked: :func:`cell_ranks`), once every rule that
    refuses one is checked (``hang_notice_s``: the cell's own, or the session's). ``timeout_s``
    is read as ``%%distributed --timeout`` is (None: no limit), ``hang_notice_s`` as
    ``--hang-notice`` is (0: off): a bool, text, NaN or a negative number is refused, named as
    the driver names it (``verbs``), rather than reaching the hang watch."""
    timeout_s = parse_timeout(timeout_s, verbs.timeout)
    hang_notice_s = float(parse_number(hang_notice_s, verbs.hang_notice, "seconds", zero="off") or 0.0)
    if cell_number is not None and (isinstance(cell_number, bool) or not isinstance(cell_number, int)
                                    or cell_number < 0):  # (the notebook's are its [n]: a script's own, here)
        raise ConfigError(f"cell_number must be a whole number, 0 or more (None: the session numbers the cell); "
                          f"got {cell_number!r}")
    refuse_cell(life, verbs=verbs)  # suspended: no rank runs anything until it resumes
    refuse_dead_or_busy(group, relay, chosen, verbs)
    if stdin_ranks is not None:
        stdin_ranks = list(cell_ranks(stdin_ranks, nproc, verbs.stdin_ranks, empty=True))
        if outside := sorted(set(stdin_ranks) - set(chosen)):
            raise ConfigError(f"{verbs.stdin_ranks} names {rank_words(outside)}, which "
                              f"{'does' if len(outside) == 1 else 'do'} not run this cell (it runs on "
                              f"{rank_words(chosen)}): name ranks of {verbs.ranks}")
    try:
        limits = limits_from_env(os.environ)
    except ValueError as exc:
        raise ClorchError(f"{exc} (the output limits of %%distributed cells, read from the notebook's "
                          "environment: fix it with %env, or unset it for the default)") from None
    return CellRequest(code, chosen, timeout_s, hang_notice_s=0.0 if silent else hang_notice_s,
                       stdin_ranks=None if stdin_ranks is None else tuple(stdin_ranks), cell_number=cell_number,
                       stdin_refused=verbs.stdin_refused,
                       output_limits=limits, recover=not silent and life.state is SessionState.READY)
