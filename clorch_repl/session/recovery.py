"""The session's group formed again in the same processes: after an abort freed ranks stuck in a
collective (:mod:`.group_abort`), and when ``%clorch restart --ranks`` replaces dead ranks.

Why: the ranks hold the state a notebook is for (a model that took minutes to load, its
optimizer, the tensors being looked at); a hung collective or one dead rank used to cost every
rank of it. Here only the group is disposable: the ranks that live keep their processes and their
namespaces, and their groups get new backends in place (:mod:`clorch_repl.kernel.regroup`), so
a DDP model or an FSDP2 model built before takes its next step on the new group.

Each function does the I/O of one recovery and returns a :class:`Regrouped`; the session alone
changes its state from it (:class:`~clorch_repl.session.lifecycle.Lifecycle`). What the lines
advise is said in the words of whoever drives the session (``verbs``, :class:`~.hooks.Verbs`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..errors import ClorchError, ranks_are
from ..launchers.base import Launcher
from ..common.rank_sets import rank_words
from ..diagnosis.entries import out_of_step
from .hooks import SCRIPT_VERBS, Verbs
from .protocol import CellOutcome, CellRequest, Status
from .relay import Relay
from ..wire import PROTOCOL_VERSION
from ..wire.requests import request_code
from .sink import OutputSink

logger = logging.getLogger(__name__)

#: How long ranks freed by an abort may take to finish their cell before the re-form gives up on them.
IDLE_WAIT_S = 3.0
#: The longest a re-form request may take: the ranks' new backends meet within milliseconds when
#: every rank is there, and a rank that never comes must not hold the notebook longer than this.
REGROUP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Regrouped:
    """What a recovery did: ``ok`` when the group works again; ``line`` says it to the user."""

    ok: bool
    line: str
    #: why the group does not work (for the session's state), "" when it does
    why: str = ""
    #: the ranks that cannot be in a group now (dead or stuck), until they are replaced
    lost: tuple[int, ...] = ()


def _busy_after(relay: Relay, launcher: Launcher, wait_s: float, among: list[int] | None = None) -> list[int]:
    """Live ranks (of ``among``, default all) still running a request after up to ``wait_s``
    (freed ranks finish their cell)."""
    deadline = time.monotonic() + wait_s
    while True:
        busy = [r for r in relay.busy() if launcher.ranks[r].alive and (among is None or r in among)]
        if not busy or time.monotonic() >= deadline:
            return busy
        time.sleep(0.05)


def survivors(launcher: Launcher, lost: Iterable[int], why: str, verbs: Verbs = SCRIPT_VERBS) -> tuple[int, ...]:
    """The ranks a cell runs on while the session has lost ``lost``: the others. None left is
    refused: a cell on no rank would "succeed" having run nothing, and Run All would go on. The
    advice is a whole restart, or what works where the launcher refuses one (a detached session)."""
    gone = set(lost)
    left = tuple(p.rank for p in launcher.ranks if p.rank not in gone)
    if not left:
        instead = launcher.instead_of_replacing(sorted(gone))
        raise ClorchError(f"no rank is left to run on ({why or 'every rank was lost'}): " + (instead or (
            f"{verbs.restart} starts every rank afresh and forms the group again (their variables are gone)")))
    return left


def free_waiting(relay: Relay, launcher: Launcher, busy: list[int]) -> list[int]:
    """Before ranks are replaced: the ``busy`` ranks (others, still running a cell) freed by
    aborting the group if every one of them waits in a collective (most likely for the ranks to be
    replaced: as ending those by hand would, and the replacement forms the group again anyway);
    the ranks still busy after :data:`IDLE_WAIT_S` (all of ``busy`` when the group was left alone:
    ranks busy in their own code are not touched)."""
    if not busy or not relay.free_group(busy).aborted:  # (no ranks would abort the group at once)
        return busy
    logger.info("clorch_repl: freed ranks %s from a collective before a replacement", busy)
    return _busy_after(relay, launcher, IDLE_WAIT_S, among=busy)


def _regroup(relay: Relay, launcher: Launcher, generation: int, fresh: list[int],
             sink: OutputSink | None = None) -> CellOutcome:
    env = launcher.join_environment() if fresh else None
    code = request_code("regroup", generation=generation, fresh=fresh, env=env, protocol=PROTOCOL_VERSION)
    ranks = tuple(p.rank for p in launcher.ranks)
    return relay.execute(CellRequest(code, ranks, timeout_s=REGROUP_TIMEOUT_S), sink, silent=True)


def _failure(outcome: CellOutcome) -> str:
    failed = outcome.failed
    if not failed:
        return "it was interrupted" if outcome.interrupted else "it timed out"
    first = failed[0]
    what = first.error.evalue if first.error is not None else (first.exit or first.status.value)
    return f"rank {first.rank}: {what}"


def after_abort(relay: Relay, launcher: Launcher, generation: int, aborted_at: float,
                said_dead: Iterable[int] = (), verbs: Verbs = SCRIPT_VERBS) -> Regrouped:
    """The group was aborted at ``aborted_at`` (time.monotonic()), or a rank died: once every live
    rank is out of its cell, give the groups new backends (re-form ``generation``); with a rank
    dead, abort the survivors' groups and say who is lost instead. ``said_dead``: ranks whose death
    the caller's own report says already (a cell's), which the line does not say again."""
    dead = [p for p in launcher.ranks if not p.alive]
    if dead:  # the survivors' groups are broken: abort them too (an NCCL peer's death can hang a later call)
        relay.free_group([])  # (with no ranks to ask about: aborted at once)
    busy = _busy_after(relay, launcher, IDLE_WAIT_S)
    if dead or busy:
        return lost(launcher, [p.rank for p in dead], busy, said_dead, verbs)
    t0 = time.monotonic()
    outcome = _regroup(relay, launcher, generation, [])
    logger.info("clorch_repl: re-form %d: %.3f s after the abort the ranks were free; the re-form took %.3f s",
                generation, t0 - aborted_at, time.monotonic() - t0)
    if not outcome.ok:
        why = f"the group could not be formed again ({_failure(outcome)})"
        fresh = launcher.instead_of_restarting() or f"{verbs.restart} gives fresh ranks and a fresh group"
        return Regrouped(False, f"clorch: the group was aborted, but {why}; every rank kept its variables: {fresh}", why)
    took = time.monotonic() - aborted_at
    return Regrouped(True, f"clorch: the group was aborted and formed again in {took:.1f} s; every rank kept its "
                           "variables (the collective that did not complete on every rank is lost: run that step again)")


def abort_if_out_of_step(relay: Relay, outcome: CellOutcome) -> None:
    """After a failed cell with every rank out of it: when the ranks' collectives no longer line
    up (:func:`clorch_repl.diagnosis.entries.out_of_step`: one rank's collective timed out, or
    raised, where another never called it), abort the group now, as a stuck collective's is,
    so that :func:`after_abort` forms it again in place. Left alone, every later collective on
    it failed ("Application timeout caused pair closure") until a restart cost a rank its
    variables (a try-out: gloo's timeout, ``%clorch start --timeout 5``)."""
    if any(part.status is Status.STUCK for part in outcome.ranks.values()):
        return  # (a rank still in its cell: the stuck report stands, and it may not answer in time)
    why = out_of_step(relay.light_answers())
    if why is None:
        return
    logger.info("clorch_repl: %s: aborting the group to form it again", why)
    if relay.free_group([]).aborted:
        outcome.group_aborted, outcome.aborted_at = True, time.monotonic()


def died_between_cells(launcher: Launcher) -> list[int]:
    """The ranks that died since the last cell (none when every rank lives)."""
    return launcher.dead()


def died_between_cells_error(launcher: Launcher, dead: list[int], line: str) -> ClorchError:
    """The refusal of the first cell after ranks died between cells, once the session has done what
    it does after a death in a cell (``line``, :func:`lost`'s, which does not name them again): the
    cell is refused, since nobody has said yet that a rank is gone, and later ones run on the others,
    as after a death in a cell. Before, every later cell was refused too, and a death in a cell led
    to cells on the survivors: one rule for both now."""
    what = ", ".join(f"{p.where} ({p.exit})" for p in launcher.ranks if p.rank in dead)
    return ClorchError(f"{what} died since the last cell, so this cell was not run; {line.removeprefix('clorch: ')}")


def lost(launcher: Launcher, dead: list[int], stuck: list[int], said_dead: Iterable[int] = (),
         verbs: Verbs = SCRIPT_VERBS) -> Regrouped:
    """Some ranks cannot be in a group now (dead, or still stuck): the others keep their state and
    go on without one until the lost ranks are replaced. The line leaves out the deaths of
    ``said_dead``, which the report it ends said already ("rank 1 died (exit code 1); rank 1 died;
    ..." in a try-out); the state's ``why`` names every one."""
    gone = sorted(set(dead) | set(stuck))
    keep = [p.rank for p in launcher.ranks if p.rank not in gone and p.alive]
    said = set(said_dead)

    def lost_words(dead: list[int]) -> str:
        parts = [f"{rank_words(dead)} died"] if dead else []
        return " and ".join([*parts, f"{ranks_are(stuck)} still stuck"] if stuck else parts)

    why, told = lost_words(dead), lost_words([r for r in dead if r not in said])
    told = f"{told}; " if told else ""
    if instead := launcher.instead_of_replacing(gone):  # never the restart this launcher refuses
        kept = (f"{rank_words(keep)} kept {'its' if len(keep) == 1 else 'their'} variables but "
                f"{'has' if len(keep) == 1 else 'have'} no group (cells run on {rank_words(keep)} meanwhile; "
                "collectives there fail)" if keep else "no rank is left")
        return Regrouped(False, f"clorch: {told}{kept}: {instead}", why, tuple(gone))
    if not keep:
        line = (f"clorch: {told}no rank is left: {verbs.restart} starts every rank afresh and forms the group "
                "again (their variables are gone)")
        return Regrouped(False, line, why, tuple(gone))
    kept = f"{rank_words(keep)} kept {'its' if len(keep) == 1 else 'their'} variables"
    line = (f"clorch: {told}{kept} but {'has' if len(keep) == 1 else 'have'} no group until "
            f"{verbs.restart_ranks.format(ranks=','.join(str(r) for r in gone))} starts "
            f"{'it' if len(gone) == 1 else 'them'} "
            f"afresh and forms the group again (cells run on {rank_words(keep)} meanwhile; collectives there fail)")
    return Regrouped(False, line, why, tuple(gone))


def replace(relay: Relay, launcher: Launcher, ranks: list[int], generation: int,
            progress: Callable[[str], None], sink: OutputSink | None = None, verbs: Verbs = SCRIPT_VERBS) -> Regrouped:
    """Fresh processes for ``ranks`` (ended first if alive) and the group formed again at the same
    world size with the others, who keep their namespaces (re-form ``generation``)."""
    t0 = time.monotonic()
    launcher.replace(ranks, progress)
    relay.connect(lambda k, total: progress(f"fresh ranks ready {k}/{total}"), ranks=ranks)
    progress(f"{rank_words(ranks)} ready; forming the group again with the others")
    outcome = _regroup(relay, launcher, generation, ranks, sink)
    if not outcome.ok:
        why = f"the group could not be formed again ({_failure(outcome)})"
        return Regrouped(False, f"clorch: {why}; {verbs.restart} gives fresh ranks and a fresh group", why)
    others = [p.rank for p in launcher.ranks if p.rank not in ranks]
    kept = f"; {rank_words(others)} kept {'its' if len(others) == 1 else 'their'} variables" if others else ""
    one = len(ranks) == 1
    return Regrouped(True, f"clorch: {rank_words(ranks)} started afresh and the group formed again in "
                           f"{time.monotonic() - t0:.1f} s{kept} (the fresh {'rank has' if one else 'ranks have'} "
                           f"no variables yet: give {'it' if one else 'them'} what the others hold, e.g. a "
                           "broadcast from a survivor or a sharded checkpoint loaded on every rank)")


def degraded_notice(session: Any) -> str | None:
    """One line before each cell while ``session`` (a :class:`~.session.Session`) has lost ranks,
    None otherwise: the cell runs on the others, which have no group, until the restart of the
    lost ranks gives them one, or, where the launcher cannot replace them (a detached session),
    what it says to do instead; in the words of whoever drives the session (its hooks' verbs).
    Said by :meth:`~.session.Session.finish` through the hooks' ``notice``, so that a script's
    later cells say it as the notebook's do."""
    from .lifecycle import SessionState  # (the lifecycle imports nothing of this module's)

    if session.life.state is not SessionState.DEGRADED or session.group is None:
        return None
    running = session.chosen(None)
    lost = list(session.lost)
    advice = session.group.instead_of_replacing(lost)
    restart = session.hooks.verbs.restart_ranks.format(ranks=",".join(map(str, lost)))
    return (f"clorch: {session.life.why}: cells run on {rank_words(running)}, which "
            f"{'has' if len(running) == 1 else 'have'} no group (collectives fail)"
            + (f"; {advice}" if advice else f" until {restart}"))
