"""Warm spares made when the extension loads, for the first ``%clorch start`` (see
:mod:`clorch_repl.launchers.local` on spares): made where spares are the default for the
topology a plain ``%clorch start`` would have (GPUs, or ``CLORCH_SPARES=1``), taken by a start of
that topology (which then takes about what a restart takes: a cold start imports torch in every
rank first), and ended by any other start, a stop, an unload or the kernel's exit.
"""

from __future__ import annotations

import logging
import os

from .. import cuda
from ..errors import ClorchError
from ..launchers.base import LaunchOptions
from ..launchers.local import LocalLauncher
from ..launchers.spares import SPARES_ENV, wanted_spares
from ..common.topology import Topology

logger = logging.getLogger(__name__)


class LoadSpares:
    """The spares warmed at load, if any (one :class:`LocalLauncher` holding them)."""

    def __init__(self) -> None:
        self.launcher: LocalLauncher | None = None

    def warm(self) -> None:
        """Start them where they are the default (``%load_ext`` calls this). A problem is a
        warning: loading never fails because of it."""
        wanted = os.environ.get(SPARES_ENV, "").strip()
        if wanted == "0" or (wanted != "1" and not cuda.device_nodes()):
            return  # no spares by default here: nothing to do, and torch need not be imported for it
        try:
            topology = LocalLauncher.topology(LaunchOptions(), nproc=None, devices=None, backend=None, timeout=None)
            if not wanted_spares(topology):
                return
            launcher = LocalLauncher(topology, LaunchOptions())
        except (ClorchError, OSError) as exc:
            logger.warning("clorch_repl: no warm spares for the first start: %s", exc)
            return
        try:
            launcher.start_spares()
        except (ClorchError, OSError, RuntimeError) as exc:
            logger.warning("clorch_repl: no warm spares for the first start: %s", exc)
        finally:
            if launcher.spares:
                self.launcher = launcher
            else:
                launcher.close()

    def take(self, launcher: str, topology: Topology, options: LaunchOptions) -> LocalLauncher | None:
        """The warm launcher when this start can use its spares (else they are ended now, saying why)."""
        warm, self.launcher = self.launcher, None
        if warm is None:
            return None
        wanted = wanted_spares(topology, options.spares)
        if launcher == LocalLauncher.name and warm.topology == topology and wanted:
            warm.adopt(options)
            return warm
        count, made_for = len(warm.spares), warm.topology
        warm.close()
        why = ("--spares 0" if not wanted else f"--launcher {launcher}" if launcher != LocalLauncher.name else
               f"they were made for {made_for.nproc} {made_for.backend} rank(s) on "
               f"{', '.join(made_for.device_label(r) for r in range(made_for.nproc))}")
        print(f"clorch: ended the {count} warm spare(s) made when the extension loaded ({why}); starting cold")
        return None

    def usage(self) -> list[tuple[int | None, int | None, bool]]:
        return self.launcher.spare_usage() if self.launcher is not None else []

    def end(self) -> int:
        """End them; how many there were (0 when none)."""
        warm, self.launcher = self.launcher, None
        if warm is None:
            return 0
        count = len(warm.spares)
        warm.close()
        return count
