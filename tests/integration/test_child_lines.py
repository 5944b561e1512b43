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


def texts(session: Session, code: str) -> dict[int, str]:
    """What each rank printed in ``code``, run on both (it must succeed)."""
    hooks = Lines()
    outcome = session.run(code, None, 60, hooks)
    assert outcome.ok, (outcome, hooks.items)
    return {r: hooks.text(r) for r in (0, 1)}


def test_an_unfinished_write_is_sent_before_the_child_is_ended(session: Session) -> None:
    """A child's text that ends no line and is never flushed (a bare ``write``) waits for its end
    only so long (kernel/child_flush.py): a worker ended without a flush still shows it."""
    code = ("import multiprocessing as mp, sys, time\n"
            "def f():\n    sys.stdout.write(f'unfinished {rank}')\n    time.sleep(30)\n"
            "p = mp.get_context('fork').Process(target=f)\np.start()\ntime.sleep(1.5)\n"
            "seen = p.is_alive()\np.terminate()\np.join()\nprint('', 'alive when shown:', seen)")
    assert texts(session, code) == {r: f"unfinished {r} alive when shown: True\n" for r in (0, 1)}


@pytest.mark.parametrize("end", ["", "\r"])
def test_a_print_without_a_line_end_is_sent_before_a_pool_ends_its_workers(session: Session, end: str) -> None:
    """A try-out's case: a worker's ``print(x, end="")`` right before ``with Pool()`` terminated it
    was lost (held for its line's end); print's last write says the line is all there is."""
    code = ("import multiprocessing as mp\n"
            f"def g(i):\n    print(f'partial{{i}}', end={end!r})\n    return i\n"
            "with mp.get_context('fork').Pool(2) as p:\n    p.map(g, range(2), chunksize=1)\nprint('done')")
    for _ in range(3):
        for text in texts(session, code).values():
            assert "partial0" in text and "partial1" in text and text.endswith("done\n"), text
