"""A rank printing in a tight loop into output that is held back, on a host whose cores are all
busy, pauses between slices of that loop (pure logic: the caller passes the clocks and sleeps).

Why: a runaway ``while True: print(...)`` on three ranks of a 2-core box stalled the notebook's
browser tab although the page had little to do. Measured in headless Chromium during such floods
(tests/browser/test_lab_glance.py; docs/PERFORMANCE.md, "A flood in the browser"): the page's main
thread spent 0.23-0.32 s of CPU over a whole 5-second flood (one stream message holding the 1,000
lines it shows, a few updates of the held-back line), while the three ranks spent 1.6-7.9
CPU-seconds printing lines that only their logs would get. The page's tasks waited for a core and
so lasted up to 236 ms (463 ms on a busier day). A terminal does to a program that writes faster
than it can show what this module does: the write blocks for a while.

What is paced: only writes the cell's budget holds back (the cell's page is full, or its rate is
spent), only when they come fast, and only when the writing thread is not getting a core of its
own. Every :data:`EVERY` such writes of a thread, if they took less than :data:`WINDOW_S` and the
thread ran for less than :data:`SHARE` of that time (it waited for a core: other processes, such
as the notebook, its server and its browser, or other ranks, want the cores too), the thread
pauses :data:`RATIO` times as long as they took. Counting writes rather than watching the gaps
between them keeps this working on a loaded host, where a thread is often preempted between two
writes. A loop that does something else between its prints (a training step printing its loss)
never waits, nor does one on a host with a core to spare; a finite burst that overflows the
budget on a saturated host (``for i in range(200_000): print(i)``) takes several times as long,
every line still in the rank's log. The pause is a ``time.sleep`` in the writing thread: it lets
go of the GIL (the kernel's control thread answers probes meanwhile), and a Ctrl-C or
``--timeout`` ends it at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)

#: how many held-back writes of a thread are counted before deciding whether it pauses (a print()
#: is two writes: its text and its newline)
EVERY = 500
#: ... how fast they must have come for a pause: 500 writes in 0.25 s is 1,000 printed lines a second
WINDOW_S = 0.25
#: ... and the share of a core below which the thread was waiting for one
SHARE = 0.8
#: the pause, in multiples of the time those writes took: such a loop gets at most 1/10 of the time
RATIO = 9.0


@dataclass
class _Window:
    """One thread's held-back writes since its last decision."""

    since: float  # the wall clock (monotonic) when the window began
    cpu: float  # the thread's CPU clock then
    count: int = 0


class Pace:
    """When a thread writing held-back output pauses, and for how long; one per cell (the rank's
    stream keeps it under its lock). Pure: the caller passes the clocks and does the sleeping."""

    def __init__(self, every: int = EVERY, window_s: float = WINDOW_S, share: float = SHARE,
                 ratio: float = RATIO) -> None:
        self.every, self.window_s, self.share, self.ratio = every, window_s, share, ratio
        self._windows: dict[int, _Window] = {}
        #: seconds of pauses so far
        self.paused_s = 0.0

    def held(self, thread: int, now: float, cpu: Callable[[], float]) -> float:
        """A write of ``thread`` was held back at ``now`` (monotonic); ``cpu``: a clock of that
        thread that stands still while it waits for a core (its CPU time, or better the wall clock
        less its run-queue wait: see :func:`.output._not_queued`), read only at a window's end.
        Returns the seconds the thread pauses now."""
        window = self._windows.get(thread)
        if window is None:
            self._windows[thread] = _Window(now, cpu())
            return 0.0
        window.count += 1
        if window.count < self.every:
            return 0.0
        took, ran = now - window.since, cpu()
        waited = ran - window.cpu < self.share * took  # the thread did not get a core of its own
        pause = took * self.ratio if 0 < took <= self.window_s and waited else 0.0
        self._windows[thread] = _Window(now + pause, ran)  # the pause is not counted as the loop's time
        self.paused_s += pause
        return pause
