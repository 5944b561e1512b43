"""Freeing ranks that an interrupt cannot free: the abort of the session's group, as the relay
does it when a cell's state machine asks (:class:`~clorch_repl.session.cell_run.FreeGroup`).

Why only on evidence: an abort costs every rank its group (formed again right after, by
:mod:`.recovery`), so it is done only when every rank still running the cell after the interrupt
shows it waits inside torch.distributed (:func:`~clorch_repl.session.cell_end.waits_in_group`).
A rank in plain Python has returned long before; one in native code outside a collective would
not be freed by it, and a rank that does not answer (native code holding its Python lock) gives
no evidence: for those the interrupt's grace and the stuck report stand, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from ..diagnosis.probe import Prober
from ..launchers.base import Launcher
from . import cell_end

logger = logging.getLogger(__name__)

#: How long the ranks get to answer the question, then the order (each comes from the rank's
#: control thread, which answers while its main thread waits in the collective).
ASK_S = 1.0


@dataclass(frozen=True)
class Freed:
    """What :func:`free_group` did: ``aborted`` the group, or not because of ``elsewhere``, the
    ranks asked about that showed no wait in a collective (in their own code, or silent): the ones
    a restart of some ranks should name, since the others wait for them."""

    aborted: bool
    elsewhere: tuple[int, ...] = ()


def free_group(prober: Prober, launcher: Launcher, ranks: Sequence[int]) -> Freed:
    """Abort the group on every live rank if each of ``ranks`` waits in it (with no ranks, at once)."""
    answers = prober.ask(list(ranks), light=True, timeout_s=ASK_S)
    elsewhere = tuple(r for r in ranks if not cell_end.waits_in_group(answers.get(r)))
    if elsewhere:
        logger.info("clorch_repl: ranks %s are not waiting in a collective; the group is left alone", elsewhere)
        return Freed(False, elsewhere)
    alive = [p.rank for p in launcher.ranks if p.alive]
    done: dict[int, Any] = prober.ask(alive, abort=True, timeout_s=ASK_S)
    silent = [r for r, answer in done.items() if answer is None]
    if silent:
        logger.warning("clorch_repl: ranks %s did not confirm the abort of their groups", silent)
    logger.info("clorch_repl: aborted the group on ranks %s: %s", alive, done)
    return Freed(True)
