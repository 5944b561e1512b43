"""A rank's forked children (a Pool's or a DataLoader's workers) and their unfinished lines
(clorch_repl.kernel.output, clorch_repl.kernel.child_flush), through the engine on a real 2-rank
gloo session. That their lines arrive whole is tests/integration/test_session.py's."""

from __future__ import annotations

from typing import Iterator

import pytest

from clorch_repl.session.engine import Session
from engine_helpers import Lines, engine_session


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    with engine_session() as engine:
        yield engine


def test_an_unfinished_line_is_sent_before_the_child_is_ended(session: Session) -> None:
    """A child's line that never ends (``end=""``, no flush) waits for its end only so long: a
    worker ended without a flush (``with Pool()`` terminates its workers) still shows it."""
    code = ("import multiprocessing as mp, time\n"
            "def f():\n    print(f'unfinished {rank}', end='')\n    time.sleep(30)\n"
            "p = mp.get_context('fork').Process(target=f)\np.start()\ntime.sleep(1.5)\np.terminate()\np.join()\n"
            "print('after', p.exitcode)")
    hooks = Lines()
    assert session.run(code, None, 60, hooks).ok
    for r in (0, 1):
        assert hooks.text(r) == f"unfinished {r}after -15\n", hooks.items


def test_a_progress_rewrite_without_a_flush_shows_while_the_child_runs(session: Session) -> None:
    """A worker's ``"\\r"`` update that it never flushes reaches the rank while the worker still
    runs, not only once it ends."""
    code = ("import multiprocessing as mp, time\n"
            "def f():\n    print('\\r50%', end='')\n    time.sleep(30)\n"
            "p = mp.get_context('fork').Process(target=f)\np.start()\ntime.sleep(1.5)\n"
            "seen = p.is_alive()\np.terminate()\np.join()\nprint('', 'alive when shown:', seen)")
    hooks = Lines()
    assert session.run(code, None, 60, hooks).ok
    for r in (0, 1):
        assert hooks.text(r) == "\r50% alive when shown: True\n", hooks.items


@pytest.mark.parametrize("end", ["", "\r"])
def test_a_print_without_a_line_end_is_sent_before_a_pool_ends_its_workers(session: Session, end: str) -> None:
    """A try-out's case: a worker's ``print(x, end="")`` right before ``with Pool()`` terminated it
    was lost (held for its line's end); print's last write says the line is all there is."""
    code = ("import multiprocessing as mp\n"
            f"def g(i):\n    print(f'partial{{i}}', end={end!r})\n    return i\n"
            "with mp.get_context('fork').Pool(2) as p:\n    p.map(g, range(2), chunksize=1)\nprint('done')")
    for _ in range(3):
        hooks = Lines()
        assert session.run(code, None, 60, hooks).ok
        for r in (0, 1):
            text = hooks.text(r)
            assert "partial0" in text and "partial1" in text and text.endswith("done\n"), hooks.items
