"""A cell's state machine (clorch_repl.session.cell_run) and the ledger that routes messages to it
(clorch_repl.session.ledger), driven by recorded message sequences: no socket, no process, no clock.

The sequences are what a rank's kernel sends (kernel/lean_execute.py counts the cell's iopub
messages in its reply; ipykernel's own path ends with an idle status), in the orders a flood, a
lost message, an interrupt or a death produce."""

from __future__ import annotations

from typing import Any

from clorch_repl.session import cell_end, flood_guard
from clorch_repl.wire import limits as flood
from clorch_repl.session.cell_run import (ABORT_GRACE_S, FAILURE_GRACE_S, GROUP_CHECK_S, INTERRUPT_GRACE_S,
                                          REPLY_DRAIN_MAX_S, REPLY_DRAIN_S, REPLY_QUIET_S, CellRun, FreeGroup,
                                          GiveUp, Interrupt)
from clorch_repl.session.ledger import ABANDONED_KEPT, CommMessage, DebugEvent, EndOfFile, InputRequest, Ledger, Show
from clorch_repl.session.protocol import CellRequest, Status
from clorch_repl.wire.framing import COUNTED_KEY, IOPUB_COUNT_KEY

#: a faulthandler stack of a rank inside its cell (not returned)
IN_CELL = ('Current thread 0x00007f (most recent call first):\n'
           '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
           '  File "<cell>", line 3 in <module>\n'
           '  File "/x/IPython/core/interactiveshell.py", line 3577 in run_code\n')


def iopub(kind: str, parent: str | None, content: dict[str, Any], counted: bool = True) -> dict[str, Any]:
    return {"header": {"msg_type": kind}, "msg_type": kind, "parent_header": {"msg_id": parent},
            "content": content, "metadata": {COUNTED_KEY: True} if counted else {}}


def text(parent: str | None, line: str = "hello\n", counted: bool = True) -> dict[str, Any]:
    return iopub("stream", parent, {"name": "stdout", "text": line}, counted)


def idle(parent: str) -> dict[str, Any]:
    return iopub("status", parent, {"execution_state": "idle"}, counted=False)


def reply(parent: str, count: int | None, **content: Any) -> dict[str, Any]:
    return {"header": {"msg_type": "execute_reply"}, "msg_type": "execute_reply", "parent_header": {"msg_id": parent},
            "content": {"status": "ok", **content}, "metadata": {} if count is None else {IOPUB_COUNT_KEY: count}}


class Cell:
    """One cell on a ledger, as the relay runs it: sent to its ranks at ``now``."""

    def __init__(self, ledger: Ledger, ranks: tuple[int, ...] = (0, 1), now: float = 0.0, name: str = "c",
                 **request: Any) -> None:
        self.ledger = ledger
        for rank in ranks:
            if rank not in ledger.running:
                ledger.add_rank(rank)
        self.run = CellRun(CellRequest("pass", ranks, **request), now, ledger.running)
        self.ids = {rank: f"{name}-{rank}" for rank in ranks}
        for rank, msg_id in self.ids.items():
            self.run.sent(rank, msg_id)
        self.shown: list[str] = []

    def iopub(self, rank: int, msg: dict[str, Any], now: float) -> list[Any]:
        effects = self.ledger.iopub(rank, msg, self.run, now)
        self.shown += [e.item.content.get("text", "") for e in effects if isinstance(e, Show)]
        return effects

    def reply(self, rank: int, msg: dict[str, Any], now: float) -> None:
        self.ledger.reply(rank, msg, self.run, now)

    def end(self) -> list[str]:
        """The lines that end the cell; a held-back report (flood.HELD_MIME) as its plain text."""
        return [item.content["text"] if item.kind == "stream" else item.content["data"]["text/plain"]
                for item in self.ledger.end(self.run)]


def test_a_cell_ends_once_each_reply_and_every_message_it_counts_are_read() -> None:
    cell = Cell(Ledger())
    cell.iopub(0, text("c-0"), 0.1)
    cell.reply(0, reply("c-0", 1), 0.2)
    assert cell.run.pending == {1}  # rank 0 done: its one counted message and its reply
    cell.reply(1, reply("c-1", 2), 0.3)  # the reply overtakes its output (iopub is another thread)
    cell.iopub(1, text("c-1", "a\n"), 0.4)
    assert not cell.run.over
    cell.iopub(1, text("c-1", "b\n"), 0.5)
    assert cell.run.over and cell.run.finished == {0, 1}
    assert cell.shown == ["hello\n", "a\n", "b\n"]
    assert cell.ledger.busy() == [] and cell.end() == []
    assert all(not entries for entries in cell.ledger.abandoned.values())  # nothing abandoned


def test_uncounted_messages_do_not_complete_the_count() -> None:
    cell = Cell(Ledger(), ranks=(0,))
    cell.reply(0, reply("c-0", 1), 0.1)
    cell.iopub(0, text("c-0", "through ipykernel's pipe\n", counted=False), 0.2)
    assert not cell.run.over
    cell.iopub(0, text("c-0"), 0.3)
    assert cell.run.over


def test_ipykernels_own_path_ends_on_its_idle_status() -> None:
    cell = Cell(Ledger(), ranks=(0,))
    cell.reply(0, reply("c-0", None), 0.1)  # no count: not the lean path
    cell.run.end_drained(0.1 + REPLY_QUIET_S - 0.01)
    assert not cell.run.over
    cell.iopub(0, idle("c-0"), 0.2)
    assert cell.run.over and cell.ledger.idle(0)


def test_lost_iopub_messages_end_the_rank_after_the_quiet_period_and_late_ones_are_dropped_and_said() -> None:
    ledger = Ledger()
    cell = Cell(ledger, ranks=(0,))
    cell.iopub(0, text("c-0"), 0.1)
    cell.reply(0, reply("c-0", 5), 1.0)  # 4 of the 5 counted messages were dropped past the high-water mark
    assert cell.run.wake_at() == [1.0 + REPLY_QUIET_S]
    cell.run.end_drained(1.0 + REPLY_QUIET_S - 0.01)
    assert not cell.run.over
    cell.run.end_drained(1.0 + REPLY_QUIET_S)
    assert cell.run.over and ledger.idle(0)  # free for the next cell
    assert cell.end() == []
    assert ledger.abandoned[0] == {"c-0": [1, 5]}
    # Between cells, one of the lost ones arrives after all: dropped, not held for the next cell.
    ledger.iopub(0, text("c-0", "x" * 2048), None, 5.0)
    assert ledger.late == [] and ledger.dropped == {0: [1, 2048]}
    nxt = Cell(ledger, ranks=(0,), name="d")
    nxt.iopub(0, text("d-0"), 6.0)
    nxt.reply(0, reply("d-0", 1), 6.1)
    assert nxt.run.over
    [said] = nxt.end()
    words = " ".join(said.split())
    assert "dropped 1 late output message(s), 2 KiB" in words and "%clorch logs 0" in words, said
    # shown as rank 0's lines, each under its "[rank 0] " label: wrapped between words to fit the cell
    assert all(len("[rank 0] " + row) <= 100 for row in said.splitlines()) and len(said.splitlines()) > 1, said


def test_output_after_the_reply_extends_the_drain_up_to_its_cap() -> None:
    cell = Cell(Ledger(), ranks=(0,))
    cell.reply(0, reply("c-0", 10_000), 1.0)
    now = 1.0
    while now < 1.0 + REPLY_DRAIN_MAX_S + 5:
        cell.iopub(0, text("c-0", counted=False), now)  # a thread still printing: keeps the rank heard
        cell.run.end_drained(now)
        if cell.run.over:
            break
        now += 1.0
    assert cell.run.over and now == 1.0 + REPLY_DRAIN_MAX_S


def test_an_abandoned_request_is_forgotten_once_its_count_is_reached() -> None:
    ledger = Ledger()
    cell = Cell(ledger, ranks=(0,), timeout_s=1.0)
    cell.iopub(0, text("c-0"), 0.1)
    assert isinstance(cell.run.next_command(1.0), Interrupt)
    cell.run.interrupted((0,), 1.0)
    cell.run.gave_up(None, {0: {"in_cell": False}}, {0: ""})  # it had returned: its reply is late
    assert cell.run.outcome.ranks[0].status is Status.RETURNED and ledger.idle(0)
    cell.end()
    assert ledger.abandoned[0] == {"c-0": [1, None]}
    ledger.iopub(0, text("c-0"), None, 2.0)
    ledger.reply(0, reply("c-0", 2), None, 2.1)
    assert ledger.abandoned[0] == {} and ledger.dropped == {0: [1, 6]}


def test_at_most_so_many_abandoned_requests_are_remembered() -> None:
    ledger = Ledger()
    for i in range(ABANDONED_KEPT + 3):
        cell = Cell(ledger, ranks=(0,), name=f"c{i}")
        cell.reply(0, reply(f"c{i}-0", 1), float(i))
        cell.run.end_drained(i + REPLY_QUIET_S)
        cell.end()
    assert len(ledger.abandoned[0]) == ABANDONED_KEPT and "c0-0" not in ledger.abandoned[0]


def test_a_flood_is_held_back_by_the_guard_and_said_once_at_the_end() -> None:
    limits = flood.Limits(volume=1000, lines=100, rate=0)
    cell = Cell(Ledger(), ranks=(0,), output_limits=limits)
    line = "spam " * 20 + "\n"
    for i in range(500):
        cell.iopub(0, text("c-0", line), i * 0.001)
    cell.reply(0, reply("c-0", 500), 1.0)
    assert cell.run.over
    assert sum(map(len, cell.shown)) <= flood_guard.backstop(limits).volume
    [withheld] = cell.ledger.end(cell.run)  # a report the display turns into the line at the cell's top
    report = withheld.content["data"][flood.HELD_MIME]
    assert withheld.rank == 0 and report["lines"] + len(cell.shown) == 500


def test_late_output_of_an_earlier_cell_passes_the_running_cells_guard_and_is_counted() -> None:
    """The rule for a thread an earlier cell left printing: what reaches the notebook while a cell
    runs passes that cell's guard, so what the guard holds of it is announced at that cell's end."""
    ledger = Ledger()
    first = Cell(ledger, ranks=(0,), name="a")
    first.reply(0, reply("a-0", 0), 0.1)
    assert first.run.over and first.end() == []
    ledger.iopub(0, text("a-0", "between cells\n", counted=False), None, 0.5)
    assert [o.content["text"] for o in ledger.take_late()] == ["between cells\n"]
    second = Cell(ledger, ranks=(0,), name="b", output_limits=flood.Limits(volume=100, lines=10, rate=0))
    for i in range(50):
        second.iopub(0, text("a-0", "thread " * 5 + "\n", counted=False), 1.0 + i * 0.01)
    second.reply(0, reply("b-0", 0), 2.0)
    assert second.run.over and 0 < len(second.shown) < 50
    [withheld] = second.end()
    assert "held back" in withheld


def test_a_time_limit_interrupts_waits_the_grace_and_reports_stuck_and_returned_ranks() -> None:
    ledger = Ledger()
    cell = Cell(ledger, timeout_s=5.0)
    assert cell.run.next_command(4.9) is None and 5.0 in cell.run.wake_at()
    command = cell.run.next_command(5.0)
    assert command == Interrupt((0, 1), diagnose=True) and cell.run.outcome.timed_out
    cell.run.diagnosed("where they were")
    cell.run.interrupted(command.ranks, 5.1)
    assert cell.run.next_command(5.2) is None
    assert cell.run.outcome.diagnosis == "where they were"
    give_up = cell.run.next_command(5.1 + INTERRUPT_GRACE_S)
    assert give_up == GiveUp((0, 1), hurry=False, diagnose=False)
    cell.run.gave_up(None, {0: {"in_cell": False}, 1: {"in_cell": True}}, {0: "", 1: IN_CELL})
    outcome = cell.run.outcome
    assert outcome.ranks[0].status is Status.RETURNED and outcome.ranks[0].stack is None
    assert outcome.ranks[1].status is Status.STUCK and outcome.ranks[1].stack == IN_CELL
    assert cell.run.over and ledger.busy() == [1]  # the stuck rank still runs it: the next cell is refused
    assert not outcome.ok and not outcome.cut_short


def test_a_reply_that_was_in_flight_during_the_interrupt_drains_briefly() -> None:
    cell = Cell(Ledger(), ranks=(0,), timeout_s=1.0)
    cell.run.interrupted(cell.run.next_command(1.0).ranks, 1.0)  # type: ignore[union-attr]
    cell.reply(0, reply("c-0", 99), 1.5)  # its output is still queued behind: not shown
    assert min(cell.run.wake_at()) == 1.5 + REPLY_DRAIN_S
    cell.run.end_drained(1.5 + REPLY_DRAIN_S)
    assert cell.run.over and cell.run.outcome.ranks[0].status is Status.OK


def test_a_second_interrupt_ends_the_wait_at_once_and_asks_nothing() -> None:
    cell = Cell(Ledger())
    assert cell.run.user_interrupt() is False
    first = cell.run.interrupt_command()
    assert first.diagnose and first.ranks == (0, 1)
    cell.run.interrupted(first.ranks, 1.0)
    assert cell.run.user_interrupt() is True  # again: hurry
    assert cell.run.interrupt_command() == Interrupt((), diagnose=False)
    give_up = cell.run.give_up_command()
    assert give_up == GiveUp((0, 1), hurry=True, diagnose=False)
    cell.run.gave_up(None, {}, {})
    outcome = cell.run.outcome
    assert outcome.interrupted and outcome.cut_short and cell.run.over
    assert {o.status for o in outcome.ranks.values()} == {Status.STUCK}


def test_an_interrupted_rank_that_raises_keyboard_interrupt_is_interrupted_not_failed() -> None:
    cell = Cell(Ledger(), ranks=(0,))
    cell.run.user_interrupt()
    cell.run.interrupted(cell.run.interrupt_command().ranks, 1.0)
    cell.iopub(0, iopub("error", "c-0", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []}), 1.1)
    cell.reply(0, reply("c-0", 1, ename="KeyboardInterrupt"), 1.2)
    assert cell.run.over and cell.run.outcome.ranks[0].status is Status.INTERRUPTED
    assert cell.run.failed_at is None


def test_a_rank_that_dies_after_the_users_interrupt_reached_it_leaves_the_cell_ended_by_the_user() -> None:
    """Kernel > Interrupt during a start's join: a KeyboardInterrupt in the middle of torch's import
    can leave a rank that segfaults (seen in CI). Its death is the interrupt's doing: the start says
    it was interrupted, not that the rank died."""
    cell = Cell(Ledger())
    cell.run.user_interrupt()
    cell.run.interrupted(cell.run.interrupt_command().ranks, 1.0)
    cell.iopub(0, iopub("error", "c-0", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []}), 1.1)
    cell.reply(0, reply("c-0", 1, ename="KeyboardInterrupt"), 1.2)
    cell.run.died(1, "killed by signal SIGSEGV", "", "Fatal Python error: Segmentation fault", 1.3)
    outcome = cell.run.outcome
    assert outcome.ranks[1].status is Status.DIED and outcome.ranks[1].interrupted
    assert outcome.ended_by_user and not outcome.ok


def test_a_rank_that_failed_before_the_users_interrupt_keeps_its_own_failure() -> None:
    """A death or an error the interrupt did not cause is what the user must see, interrupt or not
    (a start whose rank died at once, which the user then interrupts because it waits)."""
    for fail in ("died", "raised"):
        cell = Cell(Ledger())
        if fail == "died":
            cell.run.died(1, "exit code 1", "", "ImportError: no module named x", 1.0)
        else:
            cell.iopub(1, iopub("error", "c-1", {"ename": "ValueError", "evalue": "x", "traceback": ["tb"]}), 1.0)
            cell.reply(1, reply("c-1", 1, ename="ValueError"), 1.1)
        cell.run.user_interrupt()
        command = cell.run.interrupt_command()
        assert command.ranks == (0,)
        cell.run.interrupted(command.ranks, 1.2)
        assert cell.run.outcome.interrupted and not cell.run.outcome.ranks[1].interrupted
        assert not cell.run.outcome.ended_by_user, fail


def test_a_death_is_reported_and_the_others_are_interrupted_after_the_failure_grace() -> None:
    ledger = Ledger()
    cell = Cell(ledger)
    assert cell.run.died(1, "killed by signal SIGKILL", "hostb", "the log's end", 2.0) is True
    cell.run.death_diagnosed("rank 0 waits for rank 1")
    result = cell.run.outcome.ranks[1]
    assert result.status is Status.DIED and result.exit == "killed by signal SIGKILL, on hostb"
    assert result.log_tail == "the log's end" and ledger.idle(1)
    assert cell.run.next_command(2.0 + FAILURE_GRACE_S - 0.01) is None
    assert cell.run.next_command(2.0 + FAILURE_GRACE_S) == Interrupt((0,), diagnose=False)
    assert cell.run.outcome.diagnosis == "rank 0 waits for rank 1"


def test_an_error_on_one_rank_interrupts_the_others_after_the_failure_grace() -> None:
    cell = Cell(Ledger())
    cell.iopub(0, iopub("error", "c-0", {"ename": "ValueError", "evalue": "x", "traceback": ["tb"]}), 1.0)
    cell.reply(0, reply("c-0", 1, ename="ValueError"), 1.1)
    assert cell.run.pending == {1} and cell.run.outcome.ranks[0].status is Status.ERROR
    command = cell.run.next_command(1.0 + FAILURE_GRACE_S)
    assert command == Interrupt((1,), diagnose=True)
    assert cell.run.died(1, "exit code 1", "", "", 3.5) is False  # already failed: no second diagnosis


def test_a_death_seen_just_after_the_failure_it_caused_is_diagnosed() -> None:
    """gloo fails the survivor's collective as soon as the dead rank's sockets close: its error can
    arrive before the liveness check sees the death (forked ranks: every time). The death still
    gets its verdict, once; a failure well before a death does not (see the test above)."""
    cell = Cell(Ledger())
    cell.iopub(0, iopub("error", "c-0", {"ename": "RuntimeError", "evalue": "Connection reset by peer",
                                         "traceback": ["tb"]}), 1.0)
    cell.reply(0, reply("c-0", 1, ename="RuntimeError"), 1.01)
    assert cell.run.pending == {1}
    assert cell.run.died(1, "exit code 3", "", "", 1.2) is True
    cell.run.death_diagnosed("rank 1 died (exit code 3); the last collective of rank 0 was all_reduce #2")
    assert cell.run.outcome.diagnosis.startswith("rank 1 died")


def test_a_reply_error_stands_in_for_a_dropped_iopub_error() -> None:
    cell = Cell(Ledger(), ranks=(0,))
    cell.reply(0, reply("c-0", 1, status="error", ename="RuntimeError", evalue="boom", traceback=["t"]), 1.0)
    error = cell.run.outcome.ranks[0].error
    assert error is not None and error.ename == "RuntimeError" and cell.run.failed_at == 1.0


def test_prompts_comms_and_debug_events_are_routed() -> None:
    ledger = Ledger()
    request = {"msg_type": "input_request", "content": {"prompt": "? "}}
    assert ledger.input_request(0, request, None, 0.0) == [EndOfFile(0)]
    cell = Cell(ledger)
    assert ledger.input_request(0, request, cell.run, 1.0) == [InputRequest(0, request)]
    assert cell.run.last_progress == 1.0
    comm = iopub("comm_msg", "c-0", {"comm_id": "w", "data": {}}, counted=False)
    assert cell.iopub(0, comm, 2.0) == [CommMessage(0, comm, True)]
    assert ledger.iopub(0, comm, None, 2.0) == [CommMessage(0, comm, False)]
    stopped = iopub("debug_event", None, {"event": "stopped"}, counted=False)
    assert cell.iopub(1, stopped, 3.0) == [DebugEvent(1, stopped)] and ledger.debug_paused == {1}
    cell.reply(0, reply("c-0", 0), 3.1)
    cell.reply(1, reply("c-1", 0), 3.2)
    cell.end()
    assert ledger.debug_paused == set()  # a rank whose cell ended is not paused in it


def test_settling_ends_on_the_idle_of_the_settled_request() -> None:
    ledger = Ledger()
    ledger.add_rank(0)
    ledger.settling[0] = "comm-1"
    ledger.iopub(0, idle("other"), None, 0.0)
    assert ledger.settling == {0: "comm-1"}
    ledger.iopub(0, idle("comm-1"), None, 0.1)
    assert ledger.settling == {}


def test_a_rank_still_running_after_an_interrupt_is_asked_about_the_group_once() -> None:
    """A user's cell (recover=True): one second after the interrupt the ranks still running are the
    subject of FreeGroup; an abort gives them ABORT_GRACE_S to return, marked freed, with the
    verdict taken before the interrupt kept for the report."""
    cell = Cell(Ledger(), recover=True)
    cell.run.user_interrupt()
    command = cell.run.interrupt_command()
    cell.run.diagnosed("all_reduce #2: rank 0 waits in it; rank 1 never called it")
    cell.run.interrupted(command.ranks, 10.0)
    cell.iopub(1, iopub("error", "c-1", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []}), 10.1)
    cell.reply(1, reply("c-1", 1, ename="KeyboardInterrupt"), 10.1)
    assert 10.0 + GROUP_CHECK_S in cell.run.wake_at()
    assert cell.run.next_command(10.0 + GROUP_CHECK_S - 0.01) is None
    assert cell.run.next_command(10.0 + GROUP_CHECK_S) == FreeGroup((0,))
    assert cell.run.next_command(10.0 + GROUP_CHECK_S) is None  # asked once
    cell.run.group_checked(True, 11.0)
    outcome = cell.run.outcome
    assert outcome.group_aborted and outcome.aborted_at == 11.0 and outcome.ranks[0].freed
    assert outcome.diagnosis.startswith("all_reduce #2")
    assert cell.run.next_command(11.0 + ABORT_GRACE_S - 0.01) is None  # the freed rank gets its time
    cell.iopub(0, iopub("error", "c-0", {"ename": "RuntimeError", "evalue": "Connection closed", "traceback": []}), 11.2)
    cell.reply(0, reply("c-0", 1, status="error", ename="RuntimeError"), 11.2)
    assert cell.run.over and not outcome.ranks[1].freed


def test_no_group_question_for_clorchs_own_requests_or_when_the_group_is_left_alone() -> None:
    own = Cell(Ledger())  # recover=False: a join, a transfer
    own.run.interrupted(own.run.interrupt_command().ranks, 1.0)
    assert not any(isinstance(own.run.next_command(t), FreeGroup) for t in (2.0, 3.0, 5.9))
    user = Cell(Ledger(), recover=True)
    user.run.interrupted(user.run.interrupt_command().ranks, 1.0)
    now, asked = 1.0 + GROUP_CHECK_S, 0
    while (command := user.run.next_command(now)) is not None and isinstance(command, FreeGroup):
        asked += 1
        user.run.group_checked(False, now)  # not every rank waits in a collective: asked again later
        now += GROUP_CHECK_S
    assert asked == int(INTERRUPT_GRACE_S / GROUP_CHECK_S) - 1 and not user.run.outcome.group_aborted
    assert user.run.next_command(1.0 + INTERRUPT_GRACE_S) == GiveUp((0, 1), hurry=False, diagnose=True)


def test_waits_in_group_reads_the_flight_recorder_and_the_stack() -> None:
    pending = {"fr": {"pg_status": {"fr/0": {"last_enqueued_collective": 3, "last_completed_collective": 2}}},
               "stack": []}
    done = {"fr": {"pg_status": {"fr/0": {"last_enqueued_collective": 3, "last_completed_collective": 3}}},
            "stack": [{"file": "/env/site-packages/torch/distributed/distributed_c10d.py"}]}
    python = {"fr": {"pg_status": {}}, "stack": [{"file": "<cell>"}]}
    assert cell_end.waits_in_group(pending) and cell_end.waits_in_group(done)
    assert not cell_end.waits_in_group(python)
    assert not cell_end.waits_in_group(None) and not cell_end.waits_in_group({"error": "x"})
