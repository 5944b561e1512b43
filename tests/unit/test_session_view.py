"""The session's read-only view (clorch_repl.session.view): what ``%clorch status`` and ``%clorch
top`` show of a session comes from it alone.

No process here: ``_Launcher`` stands in for a launcher in what the view reads of it (its ranks'
process facts and a log tail), which a unit test cannot start; the view over real ranks is read by
tests/integration/test_top.py and test_session.py (status).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import pytest

from clorch_repl.session.cell_labels import RankCells
from clorch_repl.session.lifecycle import Lifecycle, SessionState
from clorch_repl.notebook.panel import Tracker, snapshot, suspended_note
from clorch_repl.session.panel_view import render
from clorch_repl.session.protocol import RankState
from clorch_repl.session.rank_report import rank_reports
from clorch_repl.session.view import session_view
from clorch_repl.common.topology import Topology


@dataclass
class _Proc:
    rank: int
    alive: bool = True
    exit: str | None = None
    host: str = ""
    pid: int | None = 100
    started_at: float = 0.0


class _Launcher:
    """Stands in for a launcher: its ranks' process facts and their log tails (no process here)."""

    name = "local"

    def __init__(self, procs: list[_Proc]) -> None:
        self.ranks = procs

    def current_log_tail(self, rank: int, lines: int) -> str:
        return f"step 3 of rank {rank}\n"


def _view(life: Lifecycle, *, started_at: float | None = 1.0, busy: tuple[int, ...] = (1,), last_lines: bool = False):
    procs = [_Proc(0, started_at=time.time() - 60), _Proc(1, started_at=time.time() - 60),
             _Proc(2, alive=False, exit="exit code 3"), _Proc(3, host="hostB")]
    cells = RankCells()
    cells.sent("[7] train()", (0, 1, 2, 3))
    return session_view(_Launcher(procs), busy, life, cells, Topology(nproc=4, devices=(None,) * 4, backend="gloo", timeout_s=60.0),  # type: ignore[arg-type]
                        generation=2, started_at=started_at, last_lines=last_lines)


def test_status_rows_say_each_ranks_state_from_the_view() -> None:
    view = _view(Lifecycle(SessionState.READY))
    rows = rank_reports(view, {0: (1 << 20, None), 2: (5, 5)})
    assert [r.state for r in rows] == [RankState.IDLE, RankState.BUSY, RankState.DEAD, RankState.IDLE]
    assert rows[2].exit == "exit code 3" and rows[2].memory_bytes is None and rows[2].uptime_s == 0.0
    assert rows[0].memory_bytes == 1 << 20 and 59 < rows[0].uptime_s < 120 and rows[3].host == "hostB"
    assert view.hosts == {3: "hostB"} and view.generation == 2 and view.launcher == "local"
    from clorch_repl.magics.views import status_rows
    _, body = status_rows(rows)
    assert body[2][-1] == "-" and body[0][-1] != "-", body  # a dead rank has no uptime (it read "0s")
    from clorch_repl.common.procs import describe_exit
    killed = dataclasses.replace(rows[2], exit=describe_exit(-9))
    assert status_rows([killed])[1][0][1] == "dead (killed by signal SIGKILL)"  # the OOM hint widened every row
    starting = _view(Lifecycle(SessionState.STARTING), started_at=None)
    assert [r.state for r in starting.ranks] == [RankState.STARTING] * 2 + [RankState.DEAD, RankState.STARTING]


def test_the_panel_shows_the_busy_ranks_cell_and_local_log_lines_from_the_view() -> None:
    view = _view(Lifecycle(SessionState.READY), last_lines=True)
    snaps, stuck = snapshot(view, Tracker())
    text = render(snaps)["text/plain"]
    assert not stuck and "[7] train()" in text and "step 3 of rank 0" in text
    assert [s.cell for s in snaps] == [None, "[7] train()", None, None]  # only the busy rank runs a cell
    assert snaps[3].last_line is None  # another host's log is not read here
    assert "dead (exit code 3)" in text


def test_a_suspended_sessions_panel_says_so_and_the_view_cannot_be_changed() -> None:
    life = Lifecycle(SessionState.READY)
    assert suspended_note(_view(life)) is None
    life.move("suspend")
    life.move("suspended", "20.0 GiB of GPU memory held in host memory")
    view = _view(life)
    assert suspended_note(view) == "suspended: 20.0 GiB of GPU memory held in host memory"
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.state = SessionState.READY  # type: ignore[misc]
