"""How many warm spare sets a start keeps (``%clorch start --spares``, ``CLORCH_SPARES``): one
policy for every launcher that keeps spares (the local launcher's own, a remote rank's nanny's).
What a spare is: :mod:`.local`'s docstring.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..common import env_vars
from ..errors import ConfigError
from ..common.topology import Topology

logger = logging.getLogger(__name__)

#: ``0`` or ``1``: the default of ``%clorch start --spares`` (and whether loading the extension
#: warms spares for the first start), for every topology; unset: one set for GPU ranks only
SPARES_ENV = env_vars.SPARES.name


def wanted_spares(topology: Topology, given: int | None = None) -> int:
    """Warm spare sets to keep: ``given`` (``--spares``) when not None, else ``$CLORCH_SPARES``
    when set, else one for GPU ranks and none for CPU ranks.

    On GPUs a cold rank start (interpreter, imports, then CUDA) made most of a 7 s restart; on CPU
    ranks a restart took about 2 s in all, and spares there would hold memory and, on a small
    machine, take CPU from the user's first cells while they start."""
    if given is not None:
        return given
    env = os.environ.get(SPARES_ENV, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ConfigError(f"{SPARES_ENV}={env!r} in the environment must be 0 (no warm spares) or 1 "
                              "(one per rank); fix or unset it")
        return int(env)
    return 1 if topology.uses_gpu else 0


def end_spares(launcher: Any) -> int:
    """End ``launcher``'s warm spares now; how many. A suspend gives back what they hold (issue
    37), and the launcher's ``group_formed`` starts a set again at the resume. A launcher that keeps
    none on this host (a nanny's spare is its host's business) has none to end."""
    spares = list(getattr(launcher, "spares", None) or [])
    if not spares:
        return 0
    launcher.spares = []
    launcher._end(spares, 1.0, polite=False)  # the local launcher's own way of ending its kernels
    return len(spares)


def lost_spares(launcher: Any) -> str:
    """"the warm spare made rank 1 ended (killed by signal SIGKILL)" when ``launcher``'s ranks of
    this start were warm spares and one of them is gone; "" otherwise (a cold start's failure
    stands). (A session's start asks it, to start the ranks cold once instead of failing.)"""
    if launcher is None or not launcher.from_spares:
        return ""
    dead = [f"rank {p.rank} ({p.exit or 'gone'})" for p in launcher.ranks if not p.alive]
    if not dead:
        return ""
    return f"the warm spare made {', '.join(dead)} ended"
