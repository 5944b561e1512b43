"""Whether a remote rank is lost, and what the notebook says to a nanny that comes back (pure).

Why: a rank not heard from for ``LOST_AFTER_S`` is reported lost (its cell fails naming it, a
stop names it as unreachable). It used to be "lost" only while it stayed silent: once the link
came back, its nanny's heartbeats made it look alive again, and the notebook's heartbeats kept the
nanny from its orphan timeout, so it waited for ever beside a session that had written it off
(``%clorch stop`` after a cut and restored link left processes on the host). Now lost is final for
the session: the verdict is latched the first time it is reached, the notebook stops sending that
nanny heartbeats (so it orphans on its own even if nothing reaches it), and anything the nanny
sends afterwards is answered with an ``exit`` saying why, so it ends its kernel and leaves at once.
``%clorch restart`` (a fresh group) is the way back to a full world.
"""

from __future__ import annotations

import logging
from typing import Any

from ..wire.nanny import FromNanny, ToNanny

logger = logging.getLogger(__name__)

#: The exit status a nanny told to end after being declared lost leaves with (see clorch_repl.host.nanny).
LOST_EXIT_CODE = 4


def is_lost(declared: bool, silent_s: float, lost_after_s: float) -> bool:
    """Whether a rank is lost now: declared so before, or silent for longer than ``lost_after_s``."""
    return declared or silent_s > lost_after_s


def answer_to_lost(rank: int, host: str, op: str | None, silent_s: float) -> dict[str, Any] | None:
    """What the notebook answers a message ``op`` from a rank it declared lost: an ``exit`` (the
    nanny then ends its kernel), unless the nanny is already reporting its own end."""
    if op == FromNanny.EXITED:
        return None
    return {"op": ToNanny.EXIT, "code": LOST_EXIT_CODE,
            "why": (f"the notebook declared rank {rank} on {host} lost after {silent_s:.0f} s without a word "
                    "(link cut or host down) and has written it off; %clorch restart in the notebook starts "
                    "a fresh group")}
