"""``%clorch top``: open, print once, or close the live rank panel (:mod:`clorch_repl.session.panel`)."""

from __future__ import annotations

import argparse
from typing import Any

from IPython.display import display

from ..errors import ConfigError
from ..session.panel import INTERVAL_S, Panel, _Tracker, snapshot, suspended_note, _ONCE_WITHIN_S
from ..session.panel_view import render

__all__ = ["command"]


def command(session: Any, panel: Panel | None, args: argparse.Namespace) -> Panel | None:
    """Carry out ``%clorch top`` with parsed ``args``; returns the panel that is open afterwards."""
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
        import time

        prober = session.relay.new_prober()
        note = suspended_note(session)  # suspended ranks are not asked
        try:
            tracker = _Tracker()
            answers = {} if note else prober.ask([p.rank for p in session.group.ranks if p.alive], light=True,
                                                 usage=True, timeout_s=_ONCE_WITHIN_S)
            now = time.monotonic()
            tracker.answers.update({r: (now, a) for r, a in answers.items() if a is not None})
            snaps, _ = snapshot(session, tracker, now)
        finally:
            prober.close()
        display(render(snaps, note=note), raw=True)
        return panel
    if panel is not None and panel.open:
        panel.close()  # one live panel at a time: the new one replaces it
    opened = Panel(session, interval_s=interval)
    opened.start()
    return opened
