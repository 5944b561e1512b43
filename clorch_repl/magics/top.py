"""``%clorch top``: open, print once, or close the live rank panel (:mod:`clorch_repl.notebook.panel`)."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from IPython.display import display

from ..errors import ConfigError
from ..notebook.panel import INTERVAL_S, Panel, snapshot_once
from ..session.panel_view import render

__all__ = ["command"]


def command(source: Callable[[], Any], panel: Panel | None, args: argparse.Namespace) -> Panel | None:
    """Carry out ``%clorch top`` with parsed ``args``; returns the panel that is open afterwards.
    ``source`` finds the notebook's session now: the live panel follows it through restarts.

    The CPU column is a share of time, so it needs two samples: ``--once`` and the live panel's
    first draw ask every rank twice, :data:`~clorch_repl.notebook.panel.CPU_SAMPLE_S` (0.4 s)
    apart, and show the second answer (a single first question said 0 % for a busy rank, having
    no earlier sample); later rounds of the live panel measure over their interval."""
    if args.stop:
        if panel is None or not panel.open:
            print("clorch: no %clorch top panel is open")
            return None
        panel.close()
        print("clorch: closed the %clorch top panel")
        return None
    interval = INTERVAL_S if args.interval is None else args.interval
    if not interval >= 0.2:
        raise ConfigError(f"--interval must be at least 0.2 seconds; got {args.interval!r}")
    if args.once:
        snaps, note, verdict = snapshot_once(source())
        display(render(snaps, verdict, note=note), raw=True)
        return panel
    if panel is not None and panel.open:
        panel.close()  # one live panel at a time: the new one replaces it
    opened = Panel(source, interval_s=interval)
    opened.start()
    return opened
