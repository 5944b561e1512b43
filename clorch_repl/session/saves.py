"""Asynchronous checkpoint saves still writing when the ranks are about to end politely.

Why: ``save_checkpoint(..., async_save=True)`` returns once the state is in host memory and a
thread of the rank writes and commits it. That thread does not keep a rank alive (a daemon: a
rank that must end now, a dead group's or a hung one's, ends, and the checkpoint at the path stays
the one before). But a polite end (``%clorch stop``, a whole ``%clorch restart``, the extension's
unload) of ranks that look idle threw such a save away without a word, although its handle had
promised the state at the call (a new user's try-out found it). So before a polite end, the
session asks the ranks over control whether a save is writing (as ``%clorch status`` does, no
cell), and if one is, it says so and waits for the commit in a silent request; an interrupt ends
the wait, and the ranks end without it. Nothing is asked of ranks that are busy or dead: they are
ended at once, as before.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..common.rank_sets import rank_words
from ..errors import DistributedCellError
from ..wire.requests import request_code
from .protocol import CellRequest, Status

logger = logging.getLogger(__name__)


def logged(text: str) -> None:
    """Where what :func:`finish_saves` says goes when nobody shows it (a script's session)."""
    logger.warning("clorch_repl: %s", text)


def before_polite_end(session: Any, say: Callable[[str], None]) -> None:
    """Before ``session``'s ranks are asked to end: its saves in flight finished (see the module's
    docstring), if every rank is alive and idle; a busy or dead one is ended at once anyway."""
    group, relay = session.group, session.relay
    if session.running and group is not None and all(p.alive for p in group.ranks) and not relay.busy():
        finish_saves(relay, session.saves_in_flight(), say)


def finish_saves(relay: Any, saves: dict[int, list[dict[str, Any]]], say: Callable[[str], None]) -> bool:
    """Wait for the asynchronous saves ``saves`` (rank -> what ``in_flight()`` answered there)
    to be committed, telling ``say`` what happens; whether there was one. ``relay``: the
    session's, with every rank idle."""
    if not saves:
        return False
    paths = sorted({str(entry.get("path")) for entries in saves.values() for entry in entries})
    ranks = tuple(sorted(saves))
    say(f"waiting for the asynchronous checkpoint save to {', '.join(paths)} ({rank_words(ranks)}) to be "
        "committed before the ranks end; interrupt to end them without it (the checkpoint there then stays "
        "the one before)")
    began = time.monotonic()
    outcome = relay.execute(CellRequest(request_code("finish_saves"), ranks), silent=True)
    if outcome.ok:
        say(f"the checkpoint save was committed ({time.monotonic() - began:.1f} s); ending the ranks")
    elif outcome.interrupted:
        say("the checkpoint save was not waited for: the ranks end without it")
    elif dead := [o for o in outcome.failed if o.status is Status.DIED]:
        # the others were interrupted after it: its death is the news, said once
        say(f"the checkpoint save was not committed: {rank_words([o.rank for o in dead])} died during the wait "
            f"({dead[0].exit}), so the checkpoint there stays the one before; ending the ranks")
    else:
        say(f"the checkpoint save failed ({DistributedCellError(outcome).summary()}); ending the ranks")
    logger.info("waited %.1f s for the asynchronous save to %s: %s", time.monotonic() - began, paths,
                "committed" if outcome.ok else "not committed")
    return True
