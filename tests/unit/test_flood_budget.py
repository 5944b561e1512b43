"""The output budget (clorch_repl.wire.limits): what a rank publishes of a cell's writes, given
recorded write sequences and clock readings, and how IPython's record of relayed text is bounded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from clorch_repl.session.flood_guard import bound_history
from clorch_repl.wire.limits import DEFAULT_LINES, DEFAULT_RATE, DEFAULT_VOLUME, Budget, Limits, limits_from_env


def replay(limits: Limits, writes: list[tuple[float, str]]) -> tuple[Budget, str]:
    budget = Budget(limits, writes[0][0] if writes else 0.0)
    shown = "".join(text for at, text in writes if budget.admit(text, at))
    return budget, shown


def test_a_flood_is_cut_at_the_volume_and_counted_whole() -> None:
    # print('spam ' * 20) in a loop: ipykernel sees two writes per print (the text, then "\n").
    writes = [(i * 1e-6, piece) for i in range(20_000) for piece in ("spam " * 20, "\n")]
    budget, shown = replay(Limits(volume=10_000, lines=0, rate=0), writes)
    total = sum(len(t) for _, t in writes)
    assert len(writes) == 40_000
    assert 0 < len(shown) <= 10_000
    assert shown.endswith("\n") and all(line == ("spam " * 20) for line in shown.splitlines())
    assert budget.sent_chars + budget.held_chars == total
    assert budget.sent_lines + budget.held_lines == 20_000
    report = budget.held_report(3)
    assert report == {"rank": 3, "lines": budget.held_lines, "chars": budget.held_chars, "late": False}


def test_lines_are_limited_as_well_as_characters() -> None:
    writes = [(0.0, "x\n")] * 500
    budget, shown = replay(Limits(volume=0, lines=100, rate=0), writes)
    assert shown.count("\n") == 100 and budget.held_lines == 400


def test_the_rate_lets_a_burst_through_then_meters_and_recovers() -> None:
    rate = 1000
    # 10 s of writing 1,000 characters every 0.1 s (10x the rate), then a pause, then one write.
    writes = [(i * 0.1, "y" * 999 + "\n") for i in range(100)] + [(20.0, "after the pause\n")]
    budget, shown = replay(Limits(volume=0, lines=0, rate=rate), writes)
    sent_in_flood = len(shown) - len("after the pause\n")
    # the bucket's 2 s of rate at once, then the rate itself over the ~10 s
    assert 2 * rate <= sent_in_flood <= 2 * rate + 10 * rate + 1000
    assert shown.endswith("after the pause\n")
    assert budget.held_chars == 100 * 1000 - sent_in_flood


def test_a_held_write_holds_the_rest_of_its_line() -> None:
    # the limit falls between a line's text and its newline: no bare "\n" is shown afterwards
    writes = [(0.0, "a" * 8), (0.0, "\n"), (0.0, "b" * 8), (0.0, "\n"), (0.0, "c"), (0.0, "\n")]
    budget, shown = replay(Limits(volume=12, lines=0, rate=0), writes)
    assert shown == "a" * 8 + "\n"
    assert budget.held_lines == 2


def test_nothing_held_says_nothing_and_no_limits_pass_everything() -> None:
    budget, shown = replay(Limits(), [(0.0, "hello\n")])
    assert shown == "hello\n" and budget.held_report(0) is None
    writes = [(0.0, "z" * 1000 + "\n")] * 5000
    budget, shown = replay(Limits(volume=0, lines=0, rate=0), writes)
    assert len(shown) == 5000 * 1001 and not budget.held


def test_limits_from_the_environment_and_the_wire() -> None:
    assert limits_from_env({}) == Limits(DEFAULT_VOLUME, DEFAULT_LINES, DEFAULT_RATE)
    got = limits_from_env({"CLORCH_OUTPUT_LIMIT": "2M", "CLORCH_OUTPUT_LINES": "0", "CLORCH_OUTPUT_RATE": "64k"})
    assert got == Limits(2 << 20, 0, 64 * 1024)
    with pytest.raises(ValueError, match="CLORCH_OUTPUT_RATE='fast' is not a size"):
        limits_from_env({"CLORCH_OUTPUT_RATE": "fast"})
    with pytest.raises(ValueError, match="negative"):
        limits_from_env({"CLORCH_OUTPUT_LIMIT": "-1"})
    assert Limits.from_wire(got.to_wire()) == got
    assert Limits.from_wire(None) == Limits()
    assert Limits.from_wire({"volume": "lots", "lines": True, "rate": 5}) == Limits(rate=5)


@dataclass
class Record:  # IPython's HistoryOutput: output_type and bundle
    output_type: str
    bundle: dict[str, Any] = field(default_factory=dict)


def test_history_keeps_a_bounded_part_of_each_cell_and_a_bounded_number_of_cells() -> None:
    outputs: dict[int, list[Any]] = {}
    exceptions: dict[int, Any] = {}
    relayed: list[int] = []
    for cell in range(1, 1001):
        outputs[cell] = [Record("out_stream", {"stream": ["[rank 0] ", "x" * 91] * 50}),
                         Record("display_data", {"text/plain": "fig"}),
                         Record("err_stream", {"stream": ["e" * 3000]})]
        exceptions[cell] = {"ename": "ClorchError"}
        bound_history(outputs, cell, chars_per_cell=4000, cells_kept=10, relayed=relayed, exceptions=exceptions)
    assert sorted(outputs) == list(range(991, 1001)) and sorted(exceptions) == list(range(991, 1001))
    last = outputs[1000]
    # 5000 of stdout would fit 4000, stderr then gets none; what is kept is one string, in order
    assert last[0].bundle["stream"] == [("[rank 0] " + "x" * 91) * 40]
    assert last[1].bundle == {"text/plain": "fig"}
    assert last[2].bundle["stream"] == []


def test_a_report_is_a_display_the_notebook_reads_and_other_clients_can_show() -> None:
    from clorch_repl.wire.limits import HELD_MIME, at_source, held_display

    data = held_display({"rank": 2, "lines": 1500, "chars": 150_000, "late": False})
    assert data[HELD_MIME]["lines"] == 1500 and "%clorch logs 2" in data["text/plain"]
    # a rank keeps twice the cell's volume and lines: the notebook, keeping the cell's, holds back first
    assert at_source(Limits(volume=100, lines=10, rate=7)) == Limits(volume=200, lines=20, rate=7)


def test_at_the_line_limit_no_further_line_is_begun() -> None:
    writes = [(0.0, piece) for i in range(20) for piece in (f"line {i}", "\n")]
    budget, shown = replay(Limits(volume=0, lines=5, rate=0), writes)
    assert shown == "".join(f"line {i}\n" for i in range(5))
    assert budget.held_lines == 15 and budget.held_report(0)["lines"] == 15


def test_the_notebooks_guard_bounds_rich_output_of_a_recorded_cell() -> None:
    from clorch_repl.session.flood_guard import backstop, message_size, withheld_report
    from clorch_repl.wire.limits import HELD_MIME

    limits = backstop(Limits(volume=50_000, lines=50, rate=50))
    assert limits == Limits(volume=200_000, lines=200, rate=0)  # twice a rank's own (twice the cell's)
    # display(df) in a loop: 1,000 display_data messages of 2 KB each, then the rank's own line
    messages = [("display_data", {"data": {"text/plain": "t" * 1000, "text/html": "h" * 1000}, "metadata": {}})] * 1000
    messages.append(("stream", {"name": "stderr", "text": "done\n"}))
    guard = Budget(limits, 0.0)
    shown = [kind for kind, content in messages if guard.admit_size(*message_size(kind, content), 0.0)]
    assert shown.count("display_data") == 96  # 96 * (2,000 + 64) characters fit in 200,000, 97 do not
    assert "stream" not in shown  # the limit was reached: nothing more of this cell
    report = withheld_report(3, guard)
    assert report is not None and report[HELD_MIME]["rank"] == 3 and "%clorch logs 3" in report["text/plain"]
    assert message_size("stream", {"text": "a\nb"}) == (3, 1, False)
    assert withheld_report(0, Budget(limits, 0.0)) is None


def test_output_held_after_the_cells_line_is_announced_at_the_next_cell() -> None:
    """Issue 24's rule for a thread a cell left printing into its spent budget: what the budget
    held after the cell's held-back line went out is said once, when the next cell starts (and a
    silent request of clorch_repl's own in between carries it on to the next cell that is shown)."""
    budget = Budget(Limits(volume=100, lines=0, rate=0), 0.0)
    budget.admit("x" * 150 + "\n", 0.1)
    assert budget.held_report(0) is not None
    budget.mark_announced()
    assert budget.late_report(0) is None  # nothing since the report
    for _ in range(3):
        budget.admit("thread\n", 1.0)  # the thread, after the cell
    silent = Budget(Limits(volume=10, lines=0, rate=0), 2.0)
    silent.carry_late(budget)
    assert (silent.late_report(0) or {}).get("lines") == 3
    # The silent request's own held-back line goes out (a transfer shows it): said once, and the
    # carried part is still said at the next cell, not lost by that announcement.
    silent.admit("y" * 20 + "\n", 2.1)
    assert silent.held_report(0) is not None
    silent.mark_announced()
    assert silent.late_report(0) == {"rank": 0, "lines": 3, "chars": 21, "late": True}
    assert budget.late_report(0) == {"rank": 0, "lines": 3, "chars": 21, "late": True}
