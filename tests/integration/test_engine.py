"""The engine driven from plain Python with hooks (issue 33), on a real 2-rank gloo group: each
rank's output through the output hook, ``input()`` answered by a stdin hook, an interrupt of a
running cell, status, and a stop that leaves no process; and a script using the engine whose own
process never imports IPython (the ranks' kernels do: they are IPython kernels)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Iterator

import psutil
import pytest

from clorch_repl.common.procs import wait_gone
from clorch_repl.errors import ClorchError
from clorch_repl.session.engine import (CellHooks, NoStdin, RankOutput, Session, SessionHooks, Status,
                                        local_session)
from clorch_repl.session.lifecycle import SessionState
from clorch_repl.session.protocol import RankState
from engine_helpers import Lines

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Recorder(CellHooks):
    """What a script's hooks would do: keep each rank's output, answer prompts from a table."""

    def __init__(self, answers: dict[int, str] | None = None) -> None:
        super().__init__()
        self.items: list[RankOutput] = []
        self.prompts: list[tuple[int, str, bool]] = []
        self.answers = answers
        self.started = threading.Event()

    def output(self, item: RankOutput) -> None:
        self.items.append(item)
        if "started" in item.content.get("text", ""):
            self.started.set()

    def answer(self, rank: int, prompt: str, password: bool) -> str:
        self.prompts.append((rank, prompt, password))
        if self.answers is None or rank not in self.answers:
            raise EOFError
        return self.answers[rank]

    def text(self, rank: int, stream: str = "stdout") -> str:
        return "".join(i.content["text"] for i in self.items
                       if i.rank == rank and i.kind == "stream" and i.content.get("name") == stream)


@pytest.fixture(scope="module")
def session() -> Iterator[Session]:
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other fixtures' sessions
    engine = local_session(2, "gloo")
    engine.start()
    yield engine
    children = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert children, "the engine's ranks were not this process's children"
    assert engine.stop() == []
    assert wait_gone(children, 10) == []


def test_each_ranks_output_reaches_the_output_hook_labelled_by_its_rank(session: Session) -> None:
    hooks = Recorder()
    outcome = session.run("import sys\nprint(f'hello from {rank} of {world_size}')\n"
                          "print('warned', file=sys.stderr)\nrank * 10", None, None, hooks)
    assert outcome.ok, outcome
    for rank in (0, 1):
        assert hooks.text(rank) == f"hello from {rank} of 2\n"
        assert hooks.text(rank, "stderr") == "warned\n"
        values = [i.content["data"]["text/plain"] for i in hooks.items if i.rank == rank and i.kind == "execute_result"]
        assert values == [str(rank * 10)]


def test_input_on_the_ranks_is_answered_by_the_stdin_hook_in_rank_order(session: Session) -> None:
    hooks = Recorder({0: "zero", 1: "one"})
    outcome = session.run("name = input('your name? ')\nprint('got', name)", None, 60, hooks)
    assert outcome.ok, outcome
    assert hooks.prompts == [(0, "your name? ", False), (1, "your name? ", False)]
    assert hooks.text(0) == "got zero\n" and hooks.text(1) == "got one\n"


def test_a_rank_left_out_of_stdin_ranks_says_so_in_the_engines_words(session: Session) -> None:
    """It named ``%%distributed --stdin-ranks`` and the notebook to a script, which has neither."""
    hooks = Recorder({0: "zero"})
    outcome = session.run("name = input('your name? ')\nprint('got', name)", None, 60, hooks, stdin_ranks=[0])
    assert hooks.prompts == [(0, "your name? ", False)] and hooks.text(0) == "got zero\n"
    error = outcome.ranks[1].error
    assert error is not None and error.evalue == (
        "input() on rank 1: only rank 0 may read input in this cell (session.run's stdin_ranks); add rank 1 to "
        "stdin_ranks to answer its prompts through the stdin hook"), error
    hooks = Recorder({0: "c"})  # (rank 0's pdb: continue)
    outcome = session.run("breakpoint()\nprint('past it')", None, 60, hooks, stdin_ranks=[0])
    assert outcome.ok and hooks.text(1, "stderr").splitlines()[-1] == (
        "breakpoint() skipped on rank 1: only rank 0 may read input in this cell (session.run's stdin_ranks); add "
        "rank 1 to stdin_ranks to debug it too"), hooks.text(1, "stderr")


def test_end_of_file_from_the_hook_and_no_hook_at_all_end_the_ranks_input_with_a_reason(session: Session) -> None:
    outcome = session.run("input('? ')", [1], 60, Recorder({}))  # the hook raises EOFError for rank 1
    assert outcome.ranks[1].status is Status.ERROR and outcome.ranks[1].error.ename == "EOFError"
    outcome = session.run("input('? ')", [0], 60, Lines())
    error = outcome.ranks[0].error
    assert error is not None and "Lines answers no prompts" in error.evalue, error
    outcome = session.run("input('? ')", [0], 60, Lines(), stdin=NoStdin("this agent reads no input"))
    assert "this agent reads no input" in outcome.ranks[0].error.evalue


def test_interrupt_from_another_thread_ends_the_running_cell_and_the_ranks_keep_their_state(session: Session) -> None:
    assert session.run("kept = rank + 100", None, 30, Recorder()).ok
    hooks = Recorder()

    def interrupt_once_started() -> None:
        if hooks.started.wait(30):
            session.interrupt()

    helper = threading.Thread(target=interrupt_once_started)
    helper.start()
    t0 = time.monotonic()
    outcome = session.run("import time\nprint('started', flush=True)\ntime.sleep(120)", None, None, hooks)
    helper.join()
    assert hooks.started.is_set(), hooks.items
    assert time.monotonic() - t0 < 30
    assert outcome.interrupted and {o.status for o in outcome.ranks.values()} == {Status.INTERRUPTED}, outcome
    after = Recorder()
    assert session.run("print(kept)", None, 30, after).ok
    assert after.text(0) == "100\n" and after.text(1) == "101\n"
    assert session.interrupt() == ({}, None)  # nothing running: nothing stuck, nothing to recover


def test_interrupts_that_come_as_a_ranks_code_has_ended_leave_its_reply_and_the_session_usable(
        session: Session) -> None:
    """Ctrl-Cs that land after the rank's code returned, while its reply is on its way out, must not
    cut the reply (or the idle that stands for it): the relay would wait for that rank for good.
    The stretch is made wide enough to aim at: ipykernel's own debug pause after the code
    (``_execute_sleep``), and the kernel's log of a caught KeyboardInterrupt made slow, so that a
    second SIGINT lands inside that handler (before the fix it escaped it: no reply, no idle)."""
    setup = ("import time\nk = get_ipython().kernel\n_clorch_log_error = k.log.error\n"
             "k.log.error = lambda *a, **kw: (time.sleep(1.0), _clorch_log_error(*a, **kw))\n"
             "k._execute_sleep = 2.0\nimport os\nos.getpid()")
    hooks = Recorder()
    assert session.run(setup, None, 30, hooks).ok
    pids = [int(i.content["data"]["text/plain"]) for i in hooks.items if i.kind == "execute_result"]
    assert len(pids) == 2, hooks.items
    hooks = Recorder()

    def ctrl_c_after_the_code() -> None:
        if hooks.started.wait(30):
            for _ in range(2):  # in the pause before the reply; then inside the handler's slow log
                time.sleep(0.5)
                for pid in pids:
                    os.kill(pid, signal.SIGINT)

    helper = threading.Thread(target=ctrl_c_after_the_code)
    helper.start()
    try:
        outcome = session.run("print('started', flush=True)\nrank * 10", None, 15, hooks)
    finally:
        helper.join()
        session.run("k._execute_sleep = 0\nk.log.error = _clorch_log_error", None, 30, Recorder())
    assert not outcome.timed_out, outcome
    assert {r: o.status for r, o in outcome.ranks.items()} == {0: Status.OK, 1: Status.OK}, outcome
    values = {i.rank: i.content["data"]["text/plain"] for i in hooks.items if i.kind == "execute_result"}
    assert values == {0: "0", 1: "10"}, hooks.items
    after = Recorder()
    assert session.run("print('next', rank)", None, 30, after).ok
    assert after.text(0) == "next 0\n" and after.text(1) == "next 1\n"


class RaisesOnOutput(CellHooks):
    """An output hook with a bug: it raises at the cell's first output."""

    def output(self, item: RankOutput) -> None:
        raise RuntimeError("the hook failed")


class RaisesAtCellEnd(SessionHooks):
    def cell_ended(self, cell_number: int | None) -> None:
        raise ValueError("cell_ended failed")


def wait_idle(session: Session, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while [r.state for r in session.view().ranks] != [RankState.IDLE, RankState.IDLE]:
        assert time.monotonic() < deadline, session.view()
        time.sleep(0.1)


def test_a_raising_output_hook_leaves_the_rest_of_its_cells_output_out_of_the_next_cell(session: Session) -> None:
    with pytest.raises(RuntimeError, match="the hook failed"):
        session.run("import time\nfor i in range(3):\n    print('old', i, flush=True)\n    time.sleep(0.3)",
                    None, 30, RaisesOnOutput())
    wait_idle(session)  # the cell ran on to its end on the ranks
    after = Recorder()
    assert session.run("print('new')", None, 30, after).ok
    for rank in (0, 1):
        assert "old" not in after.text(rank).replace("dropped", ""), after.items  # at most the dropped count
        assert "new\n" in after.text(rank)


def test_a_raising_cell_ended_hook_does_not_hide_the_cells_own_exception(session: Session) -> None:
    hooks, session.hooks = session.hooks, RaisesAtCellEnd()
    try:
        with pytest.raises(RuntimeError, match="the hook failed"):
            session.run("print('x')", None, 30, RaisesOnOutput())
        wait_idle(session)
        with pytest.raises(ValueError, match="cell_ended failed"):  # a cell that ended well: it is said
            session.run("1", None, 30, Recorder())
    finally:
        session.hooks = hooks
    assert session.run("1", None, 30, Recorder()).ok


class BlockingAnswer(CellHooks):
    """A script's blocking answer() that takes its time: it holds the relay's loop meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []
        self.entered, self.release = threading.Event(), threading.Event()

    def answer(self, rank: int, prompt: str, password: bool) -> str:
        self.asked.append(rank)
        self.entered.set()
        self.release.wait(30)
        return "late"


def test_an_interrupt_while_a_blocking_answer_runs_drops_the_prompts_queued_meanwhile(session: Session) -> None:
    hooks = BlockingAnswer()

    def interrupt_while_answering() -> None:
        if hooks.entered.wait(30):
            time.sleep(1.0)  # the other rank's prompt arrives meanwhile, and waits
            session.interrupt()
            hooks.release.set()

    helper = threading.Thread(target=interrupt_while_answering)
    helper.start()
    t0 = time.monotonic()
    outcome = session.run("import time\nvalue = input('n? ')\ntime.sleep(60)", None, None, hooks)
    helper.join()
    assert hooks.asked == [0], hooks.asked  # rank 1's prompt, queued when the interrupt came, is not asked
    assert outcome.interrupted and {o.status for o in outcome.ranks.values()} == {Status.INTERRUPTED}, outcome
    assert time.monotonic() - t0 < 30
    wait_idle(session)


def test_interrupts_from_another_thread_between_short_cells_never_wedge_the_session(session: Session) -> None:
    # review ex6: an interrupt that found no cell waited for used the relay's sockets and ledger from
    # its own thread while the main thread ran the next cell; after ~1000 cells every run was refused
    stop, failures, readers = threading.Event(), [], set()
    relay = session.relay
    assert relay is not None
    read = relay.channels.read

    def read_and_say_who(timeout_s: float):  # type: ignore[no-untyped-def]
        readers.add(threading.get_ident())
        return read(timeout_s)

    relay.channels.read = read_and_say_who  # type: ignore[method-assign]

    def hammer() -> None:
        while not stop.is_set():
            try:
                session.interrupt(grace_s=0.2)
            except Exception as exc:  # noqa: BLE001 - collected and asserted on below
                failures.append(f"interrupt: {exc!r}")
            time.sleep(random.uniform(0, 0.01))

    helper = threading.Thread(target=hammer)
    helper.start()
    deadline, cells, refused = time.monotonic() + 20, 0, []
    # A cell given up after the interrupt's grace leaves its rank busy until the rank finishes it,
    # and the next cells are refused meanwhile ("still running an earlier cell"): right, and how
    # long that lasts is the rank's speed under load. The loop retries at once, so the count of
    # refusals is a count of retries. What the bug did was refuse every cell from some point on:
    # the longest stretch of refusals is what is asserted (and, below, a cell after the hammer).
    refused_since: float | None = None
    longest = 0.0
    try:
        while cells < 400 and time.monotonic() < deadline:
            try:
                session.run("x = 1", None, 10, CellHooks())
            except ClorchError as exc:
                refused.append(str(exc))
                refused_since = time.monotonic() if refused_since is None else refused_since
            else:
                if refused_since is not None:
                    longest = max(longest, time.monotonic() - refused_since)
                    refused_since = None
            cells += 1
    finally:
        stop.set()
        helper.join()
        del relay.channels.read
    if refused_since is not None:  # refused up to the hammer's end
        longest = max(longest, time.monotonic() - refused_since)
    assert failures == [], failures[:5]
    assert readers == {threading.get_ident()}  # the helper never read the relay's sockets
    deadline = time.monotonic() + 15  # a rank interrupted in its last cell may still be finishing it
    while True:
        try:
            assert session.run("print('alive')", None, 10, Recorder()).ok
            break
        except ClorchError as exc:
            assert time.monotonic() < deadline, f"wedged after {cells} cells: {exc}; refused {len(refused)} times"
            time.sleep(0.2)
    assert longest < 5.0, f"cells were refused for {longest:.1f} s on end ({len(refused)} of {cells}): {refused[:3]}"


def test_status_says_the_session_is_ready_and_each_rank_idle(session: Session) -> None:
    view = session.view()
    assert view.state is SessionState.READY and view.backend == "gloo" and view.launcher == "local"
    assert [(r.rank, r.state) for r in view.ranks] == [(0, RankState.IDLE), (1, RankState.IDLE)]
    rows = session.status()
    assert [row.pid for row in rows] == session.pids() and all(row.pid for row in rows)


SCRIPT = textwrap.dedent("""
    import json, sys
    import psutil
    from clorch_repl.session.engine import CellHooks, local_session

    class Hooks(CellHooks):
        def __init__(self):
            super().__init__()
            self.lines = []

        def output(self, item):
            self.lines.append([item.rank, item.content.get("text", "")])

        def answer(self, rank, prompt, password):
            return f"answer {rank}"

    session = local_session(2, "gloo")
    session.start()
    hooks = Hooks()
    outcome = session.run("print(input('q? '))", None, 60, hooks)
    children = [p.pid for p in psutil.Process().children(recursive=True)]
    left = session.stop()
    print(json.dumps({"ok": outcome.ok, "outcome": repr(outcome), "lines": sorted(hooks.lines), "left": left,
                      "children": children,
                      "ipython": sorted(m for m in sys.modules if m.split(".")[0] in ("IPython", "ipywidgets",
                                                                                      "ipykernel"))}))
""")


def test_a_script_drives_the_engine_without_importing_ipython() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["lines"] == [[0, "answer 0\n"], [1, "answer 1\n"]], report
    assert report["ipython"] == [], report["ipython"]
    assert report["left"] == [] and report["children"]  # its ranks ran below it, and stop ended them
    assert wait_gone(report["children"], 10) == []
