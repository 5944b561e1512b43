"""The relay's I/O loop (clorch_repl.session.relay) over stand-in channels and a stand-in launcher:
it carries out what the cell's state machine decides (interrupts, giving up, deaths) and gives the
sink every line, with no socket and no process. The state machine's own cases are in
tests/unit/test_cell_run.py; here only that the relay does what they ask."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from clorch_repl.session.protocol import CellRequest, RankOutput, Status
from clorch_repl.session.relay import Relay
from clorch_repl.session.sink import PlainSink
from clorch_repl.wire.framing import COUNTED_KEY, IOPUB_COUNT_KEY


@dataclass
class FakeRank:
    rank: int
    alive: bool = True
    exit: str | None = None
    host: str = ""


@dataclass
class FakeGroup:
    ranks: list[FakeRank]
    interrupted: list[list[int]] = field(default_factory=list)

    def interrupt(self, ranks: list[int] | None = None) -> None:
        self.interrupted.append(list(ranks or []))

    def dump_stack(self, rank: int) -> str:
        return f"stack of {rank}"

    def death_report(self, rank: int) -> str:
        return f"rank {rank}'s log ends"

    def cell_began(self, ranks: tuple[int, ...]) -> None:
        """(The relay tells the launcher each cell's start; these ranks keep no logs.)"""

    def dead(self, ranks: Any = None) -> list[int]:  # (Launcher.dead's contract)
        return [r.rank for r in self.ranks if (ranks is None or r.rank in ranks) and not r.alive]

    def instead_of_replacing(self, ranks: list[int]) -> str:
        return ""  # these ranks can be replaced: the report advises %clorch restart --ranks


class FakeProber:
    def __init__(self, answers: dict[int, dict[str, Any] | None]) -> None:
        self.answers = answers

    def ask(self, ranks: list[int], **_: Any) -> dict[int, dict[str, Any] | None]:
        return {r: self.answers.get(r) for r in ranks}

    def close(self) -> None:
        pass


class FakeChannels:
    """Answers each execute_request with what ``script`` says the rank sends (None: nothing)."""

    def __init__(self, script: dict[int, int | None]) -> None:
        self.script = script
        self.queue: list[tuple[int, str, dict[str, Any]]] = []
        self.answered: list[tuple[int, str]] = []
        self.prober = FakeProber({})

    def send(self, rank: int, msg_type: str, content: Any, metadata: Any, date: str | None = None) -> str:
        msg_id = f"m{rank}"
        lines = self.script.get(rank)
        if lines is not None:
            for i in range(lines):
                self.queue.append((rank, "iopub", {
                    "header": {"msg_type": "stream"}, "msg_type": "stream", "parent_header": {"msg_id": msg_id},
                    "content": {"name": "stdout", "text": f"line {i}\n"}, "metadata": {COUNTED_KEY: True}}))
            self.queue.append((rank, "shell", {
                "header": {"msg_type": "execute_reply"}, "msg_type": "execute_reply",
                "parent_header": {"msg_id": msg_id}, "content": {"status": "ok"},
                "metadata": {IOPUB_COUNT_KEY: lines}}))
        return msg_id

    def read(self, timeout_s: float) -> Iterator[tuple[int, str, dict[str, Any]]]:
        if not self.queue:
            time.sleep(min(timeout_s, 0.05))
        queued, self.queue = self.queue, []
        yield from queued

    def answer(self, rank: int, value: str) -> None:
        self.answered.append((rank, value))

    def watch(self, socket: Any, on: bool) -> None:
        pass

    def close(self) -> None:
        pass


class Collect(PlainSink):
    def __init__(self) -> None:
        self.items: list[RankOutput] = []
        self.finals = 0

    def output(self, item: RankOutput) -> None:
        self.items.append(item)

    def flush(self, final: bool = False) -> None:
        self.finals += final


def relay_for(script: dict[int, int | None], answers: dict[int, dict[str, Any] | None] | None = None,
              ) -> tuple[Relay, FakeGroup, FakeChannels]:
    group = FakeGroup([FakeRank(r) for r in sorted(script)])
    relay = Relay(group)  # type: ignore[arg-type]
    channels = FakeChannels(script)
    relay.channels = channels  # type: ignore[assignment]
    relay._prober = FakeProber(answers or {})  # type: ignore[assignment]
    for rank in script:
        relay.ledger.add_rank(rank)
    return relay, group, channels


def test_a_cell_streams_its_output_and_ends_on_the_counted_replies() -> None:
    relay, group, _ = relay_for({0: 2, 1: 1})
    sink = Collect()
    outcome = relay.execute(CellRequest("pass", (0, 1)), sink)
    assert outcome.ok and group.interrupted == []
    assert [(i.rank, i.content["text"]) for i in sink.items] == [(0, "line 0\n"), (0, "line 1\n"), (1, "line 0\n")]
    assert sink.finals == 1 and relay.idle(0) and relay.idle(1)


def test_a_time_limit_interrupts_then_reports_returned_and_stuck_ranks() -> None:
    relay, group, _ = relay_for({0: None, 1: None}, answers={0: {"in_cell": False}, 1: {"in_cell": True}})
    started = time.monotonic()
    outcome = relay.execute(CellRequest("pass", (0, 1), timeout_s=0.2), Collect(), interrupt_grace_s=0.3)
    assert time.monotonic() - started < 3
    assert outcome.timed_out and group.interrupted == [[0, 1]]
    assert outcome.ranks[0].status is Status.RETURNED and outcome.ranks[1].status is Status.STUCK
    assert outcome.ranks[1].stack == "stack of 1" and outcome.diagnosis
    assert relay.idle(0) and not relay.idle(1)  # the stuck rank still runs it


def test_a_death_is_reported_with_its_log_and_ends_the_cell() -> None:
    relay, group, _ = relay_for({0: 1, 1: None})
    group.ranks[1].alive, group.ranks[1].exit = False, "killed by signal SIGKILL"
    outcome = relay.execute(CellRequest("pass", (0, 1)), Collect())
    assert outcome.ranks[0].status is Status.OK and outcome.ranks[1].status is Status.DIED
    assert outcome.ranks[1].exit == "killed by signal SIGKILL" and outcome.ranks[1].log_tail == "rank 1's log ends"
    assert group.interrupted == []  # rank 0 had finished: nobody left to interrupt


def test_input_asked_outside_a_cell_gets_end_of_file() -> None:
    relay, _, channels = relay_for({0: 0})
    channels.queue.append((0, "stdin", {"msg_type": "input_request", "content": {"prompt": "? "}}))
    assert relay.busy() == []
    assert channels.answered == [(0, "\x04")]


def test_a_sink_without_every_hook_is_refused_before_the_cell_runs() -> None:
    """A sink lacking comm() lost a widget message mid-cell and left its request unfinished (the
    transfers' collector did, found by review); the relay now refuses it up front, by name."""
    from clorch_repl.session.sink import OutputSink
    from clorch_repl.session.transfer import MimeCollector

    class OutputOnly:
        def output(self, item: RankOutput) -> None:
            pass

        def flush(self, final: bool = False) -> None:
            pass

    relay, group, channels = relay_for({0: 1})
    try:
        relay.execute(CellRequest("pass", (0,)), OutputOnly())  # type: ignore[arg-type]
    except TypeError as exc:
        assert "OutputOnly is not a complete output sink" in str(exc) and "comm" in str(exc)
    else:
        raise AssertionError("an incomplete sink was taken")
    assert relay.idle(0)  # nothing was sent
    assert isinstance(MimeCollector((0, 1)), OutputSink)


class _CameDeferred:
    came = True


def test_a_ctrl_c_during_the_sends_ends_the_cell_interrupted_and_leaves_nothing_begun(monkeypatch) -> None:
    """A Ctrl-C held back while a silent request (a transfer, the join) was sent: Relay.execute
    finishes it as interrupted instead of leaving it begun, which refused every later cell."""
    import contextlib

    from clorch_repl.session import relay as relay_module

    relay, _, _ = relay_for({0: 1, 1: 1})
    monkeypatch.setattr(relay_module, "ctrl_c_deferred", contextlib.contextmanager(lambda: iter([_CameDeferred()])))
    outcome = relay.execute(CellRequest("pass", (0, 1)), Collect(), silent=True, interrupt_grace_s=0.3)
    assert outcome.interrupted and relay.unfinished is None
    monkeypatch.undo()
    assert relay.execute(CellRequest("pass", (0, 1)), Collect()).ok  # the next cell runs


def test_a_ctrl_c_during_a_cells_send_comes_back_as_its_handle_marked_interrupted(monkeypatch) -> None:
    """Every way a cell begins (the magic through Session.run, the head start, clorch's own
    requests) gets the relay's handle: a Ctrl-C held back during the send does not escape begin
    (it used to, and each caller recovered the cell from Relay.unfinished in its own way); the
    handle says so, and finishing it interrupts the rank still running, shows what came first."""
    import contextlib

    from clorch_repl.session import relay as relay_module

    relay, group, _ = relay_for({0: 1, 1: None}, answers={1: {"in_cell": True}})
    monkeypatch.setattr(relay_module, "ctrl_c_deferred", contextlib.contextmanager(lambda: iter([_CameDeferred()])))
    started = relay.begin(CellRequest("pass", (0, 1)), interrupt_grace_s=0.3)  # no KeyboardInterrupt
    assert started.interrupted and relay.unfinished is started
    sink = Collect()
    outcome = relay.finish(started, sink)
    assert outcome.interrupted and group.interrupted and group.interrupted[0] == [1]
    assert outcome.ranks[0].status is Status.OK and [i.content["text"] for i in sink.items] == ["line 0\n"]
    assert relay.unfinished is None


def test_a_begun_cell_that_was_lost_is_interrupted_by_the_next_begin() -> None:
    relay, group, channels = relay_for({0: 1, 1: None})  # rank 1 never answers the lost cell
    relay.begin(CellRequest("pass", (0, 1)), interrupt_grace_s=0.3)  # and never finished
    channels.script[1] = 1  # it answers the next one
    outcome = relay.execute(CellRequest("pass", (0, 1)), Collect())
    assert outcome.ok and relay.unfinished is None
    assert group.interrupted == [[1]]  # rank 0 had answered: only rank 1 was still running it


def test_a_cell_finished_as_interrupted_reads_what_came_first_and_interrupts_only_the_running() -> None:
    """A cell the head start sent and the magic never claimed (or claimed after a Ctrl-C) is
    finished as interrupted with nothing read since its sends: ranks whose replies already wait
    are done, shown as such, and neither probed nor interrupted."""
    relay, group, _ = relay_for({0: 2, 1: None})
    started = relay.begin(CellRequest("pass", (0, 1)), interrupt_grace_s=0.3)
    sink = Collect()
    outcome = relay.finish(started, sink, interrupted=True)
    assert outcome.interrupted and group.interrupted == [[1]]
    assert outcome.ranks[0].status is Status.OK
    assert [(i.rank, i.content["text"]) for i in sink.items] == [(0, "line 0\n"), (0, "line 1\n")]

    relay, group, _ = relay_for({0: 0, 1: 0})
    outcome = relay.finish(relay.begin(CellRequest("pass", (0, 1))), Collect(), interrupted=True)
    assert group.interrupted == [] and all(r.status is Status.OK for r in outcome.ranks.values())


def test_a_ctrl_c_while_the_queued_output_is_shown_still_interrupts_the_running_ranks() -> None:
    """Users press interrupt twice: the second may land while finish(interrupted=True) shows
    what the ranks sent before it (found by review: it escaped, and rank 1 ran on, forgotten)."""

    class CtrlCOnFirstLine(Collect):
        def output(self, item: RankOutput) -> None:
            if not self.items:
                self.items.append(item)
                raise KeyboardInterrupt
            super().output(item)

    relay, group, _ = relay_for({0: 2, 1: None}, answers={1: {"in_cell": True}})
    started = relay.begin(CellRequest("pass", (0, 1)), interrupt_grace_s=0.3)
    try:
        outcome = relay.finish(started, CtrlCOnFirstLine(), interrupted=True)
    except KeyboardInterrupt:
        raise AssertionError("the second Ctrl-C escaped finish: rank 1 was left running, unread") from None
    assert outcome.interrupted and group.interrupted and 1 in group.interrupted[0]
    assert relay.unfinished is None and outcome.ranks[1].status is not Status.OK
