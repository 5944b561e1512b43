"""The pace of a print loop whose output is held back (clorch_repl.kernel.pace), on simulated clocks:
a runaway loop that waits for a core gets at most a tenth of the time, anything else never waits.
The browser test (tests/browser/test_lab_glance.py) holds the effect a user sees: a flood on three
ranks of a 2-core box no longer stalls the page."""

from __future__ import annotations

import pytest

from clorch_repl.kernel.pace import EVERY, RATIO, WINDOW_S, Pace

#: print('x' * 100) in a loop, held back: two writes per line, 8 us apart here
WRITE_S = 8e-6


class Thread:
    """A writing thread's clocks: wall time, and the CPU time it got (``share`` of the wall time
    while it runs; none while it sleeps)."""

    def __init__(self, share: float) -> None:
        self.share, self.wall, self.cpu, self.slept = share, 0.0, 0.0, 0.0

    def run(self, seconds: float) -> None:
        self.wall += seconds
        self.cpu += seconds * self.share

    def sleep(self, seconds: float) -> None:
        self.wall += seconds
        self.slept += seconds


def loop(pace: Pace, thread: Thread, writes: int, between_s: float = WRITE_S, ident: int = 1) -> None:
    for _ in range(writes):
        thread.run(between_s)
        pause = pace.held(ident, thread.wall, lambda: thread.cpu)
        assert pause >= 0
        thread.sleep(pause)


def test_a_runaway_loop_that_waits_for_a_core_gets_a_tenth_of_the_time() -> None:
    pace, thread = Pace(), Thread(share=0.5)  # three ranks spinning on two cores
    loop(pace, thread, 200_000)
    running = thread.wall - thread.slept
    assert RATIO == 9
    assert thread.slept == pytest.approx(running * RATIO, rel=0.01)  # 1 / (1 + 9) of the time writing
    assert pace.paused_s == pytest.approx(thread.slept)


def test_a_loop_with_a_core_of_its_own_never_waits() -> None:
    pace, thread = Pace(), Thread(share=1.0)  # a host with cores to spare: nobody waits for this one
    loop(pace, thread, 200_000)
    assert thread.slept == 0


def test_a_loop_that_prints_between_steps_of_work_never_waits() -> None:
    # a training step of 2 ms printing its loss, its output held back (the cell's page is full),
    # on a busy host: 1,000 writes take 2 s, far slower than a runaway loop
    pace, thread = Pace(), Thread(share=0.5)
    loop(pace, thread, 5_000, between_s=0.002)
    assert thread.slept == 0
    assert EVERY * 0.002 > WINDOW_S  # what makes it so


def test_threads_are_paced_each_on_its_own_writes() -> None:
    pace, busy, slow = Pace(), Thread(share=0.5), Thread(share=0.5)
    for _ in range(50_000):
        busy.run(WRITE_S)
        busy.sleep(pace.held(1, busy.wall, lambda: busy.cpu))
        if _ % 20 == 0:  # another thread of the cell printing now and then: its own count
            slow.run(0.01)
            slow.sleep(pace.held(2, slow.wall, lambda: slow.cpu))
    assert busy.slept > 0 and slow.slept == 0


def test_a_pause_cut_short_by_ctrl_c_never_makes_a_negative_or_longer_pause() -> None:
    pace, thread = Pace(), Thread(share=0.5)
    loop(pace, thread, EVERY + 1)
    assert thread.slept > 0
    # Ctrl-C ended the pause at once (the loop caught the KeyboardInterrupt and went on): the
    # next window's writes come "before" the pause's end; deciding on them pauses nothing
    before = thread.slept
    thread.wall -= thread.slept
    loop(pace, thread, EVERY)  # asserts every pause is >= 0
    assert thread.slept == before
