"""The status line counts a spare not yet forked as starting. Warm spares with real kernels:
tests/integration/test_spares.py."""

from __future__ import annotations


def test_the_status_line_counts_a_spare_not_yet_forked_as_starting() -> None:
    # Right after %load_ext on the H200 box the spare's kernel had no pid yet: it was left out,
    # and a set of one read "0 (pids ), ready" (a benchmark then took it for ready).
    from clorch_repl.magics.views import spares_line

    line = spares_line([(None, None, False)], "the first %clorch start")
    assert line.startswith("warm spares for the first %clorch start: 1 (pids ?), starting, "), line
    line = spares_line([(41, 2**20, True), (42, 2**20, True)])
    assert ": 2 (pids 41, 42), ready, 2.0 MiB resident in all" in line, line
