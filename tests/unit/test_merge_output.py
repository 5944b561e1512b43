"""Merging of identical rank output, tested on the display alone: RankOutput items are fed to
NotebookDisplay with no ranks at all (the protocol keeps the display testable without them).
The notebook side is IPython's real shell in this process, its output captured."""

from __future__ import annotations

import time
from typing import Any

import pytest
from IPython.utils.capture import capture_output

from clorch_repl.errors import DistributedCellError
from clorch_repl.notebook.display import MERGE_HOLD_S, NotebookDisplay, group_label
from clorch_repl.session.protocol import CellOutcome, RankError, RankOutcome, RankOutput, Status
from rank_text import lines_of


@pytest.fixture(autouse=True)
def _shell(ip: Any) -> None:
    """publish_display_data needs the shell instance the ip fixture creates."""


def out(rank: int, text: str, name: str = "stdout") -> RankOutput:
    return RankOutput(rank, "stream", {"name": name, "text": text})


def value(rank: int, text: str) -> RankOutput:
    return RankOutput(rank, "execute_result", {"data": {"text/plain": text}, "metadata": {}})


def shown(outputs: list[Any]) -> list[Any]:  # noqa: F811 - RichOutput objects, see _shown for dicts
    """The displays a cell shows, less the empty one reserved at the top of its output for the
    held-back line (clorch_repl.notebook.held_notice)."""
    return [o for o in outputs if not str((getattr(o, "transient", None) or {}).get("display_id", "")).startswith("clorch-held-")]


def feed(items: list[RankOutput], ranks: tuple[int, ...] = (0, 1), merge: bool = True) -> Any:
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=ranks, merge=merge)
        for item in items:
            sink.output(item)
            sink.flush()
        sink.flush(final=True)
    return cap


def test_labels() -> None:
    assert group_label([3]) == "[rank 3] "
    assert group_label(range(8)) == "[ranks 0-7] "
    assert group_label([0, 2, 3, 4, 7]) == "[ranks 0,2-4,7] "


def test_identical_lines_are_shown_once() -> None:
    cap = feed([out(0, "epoch 1\n"), out(1, "epoch 1\n"), out(1, "epoch 2\n"), out(0, "epoch 2\n")])
    assert cap.stdout == "[ranks 0-1] epoch 1\n[ranks 0-1] epoch 2\n"


def test_eight_ranks_one_line() -> None:
    cap = feed([out(r, "hello\n") for r in range(8)], ranks=tuple(range(8)))
    assert cap.stdout == "[ranks 0-7] hello\n"


def test_different_lines_stay_per_rank() -> None:
    cap = feed([out(0, "loss 0.5\n"), out(1, "loss 0.7\n")])
    assert cap.stdout == "[rank 0] loss 0.5\n[rank 1] loss 0.7\n"


def test_partly_identical_output_is_correct_and_in_order_per_rank() -> None:
    items = [out(0, "start\nstep 0: 1.0\n"), out(1, "start\nstep 0: 2.0\n"),
             out(1, "done\n"), out(0, "done\n")]
    cap = feed(items)
    assert lines_of(cap.stdout, 0) == ["start", "step 0: 1.0", "done"]
    assert lines_of(cap.stdout, 1) == ["start", "step 0: 2.0", "done"]
    assert cap.stdout.count("[ranks 0-1] ") == 2  # start and done, once each


def test_a_line_only_one_rank_printed_does_not_end_merging() -> None:
    # if rank == 0: print("saving"), then the same lines everywhere
    items = [out(0, "saving\n"), out(0, "epoch 1\n"), out(1, "epoch 1\n"), out(0, "epoch 2\n"), out(1, "epoch 2\n")]
    cap = feed(items)
    assert cap.stdout == "[rank 0] saving\n[ranks 0-1] epoch 1\n[ranks 0-1] epoch 2\n"


def test_a_line_one_rank_printed_first_merges_the_next_one_arriving_later() -> None:
    # rank 0's "epoch 1" arrives after rank 1's: the extra line must not spoil the merge
    cap = feed([out(0, "saving\n"), out(1, "epoch 1\n"), out(0, "epoch 1\n")])
    assert cap.stdout == "[rank 0] saving\n[ranks 0-1] epoch 1\n"


def test_interleaved_arrival_in_odd_chunks() -> None:
    items = [out(0, "a\nb"), out(1, "a\n"), out(0, "\nc\n"), out(1, "b\nc\n")]
    cap = feed(items)
    assert cap.stdout == "[ranks 0-1] a\n[ranks 0-1] b\n[ranks 0-1] c\n"


def test_stderr_and_stdout_merge_separately() -> None:
    cap = feed([out(0, "warn\n", "stderr"), out(1, "warn\n", "stderr"), out(0, "x\n"), out(1, "x\n")])
    assert cap.stderr == "[ranks 0-1] warn\n" and cap.stdout == "[ranks 0-1] x\n"


class _PageStream:
    """A stand-in for ipykernel's ``OutStream`` (a real one needs a kernel's IOPub thread): text
    written is buffered, and reaches the page, shared by both streams, only when flushed, each
    stream on its own, as ipykernel publishes them."""

    def __init__(self, name: str, page: list[tuple[str, str]]) -> None:
        self.name, self.page, self.buffer = name, page, ""

    def write(self, text: str) -> int:
        self.buffer += text
        return len(text)

    def flush(self) -> None:
        if self.buffer:
            self.page.append((self.name, self.buffer))
        self.buffer = ""


@pytest.mark.parametrize("first", ["stdout", "stderr"])
def test_lines_of_both_streams_reach_the_page_in_the_order_written(first: str, monkeypatch: Any) -> None:
    """Before: the streams were flushed in a set's order (the hash seed's), so in some processes
    a rank's sys.exit message (stderr) showed above the lines it printed before it (stdout).
    Both orders are tried, so that one of them fails whichever order a set would give."""
    second = "stderr" if first == "stdout" else "stdout"
    page: list[tuple[str, str]] = []
    monkeypatch.setattr("sys.stdout", _PageStream("stdout", page))
    monkeypatch.setattr("sys.stderr", _PageStream("stderr", page))
    with capture_output(stdout=False, stderr=False):  # the displays (the shell here would print them)
        sink = NotebookDisplay(ranks=(0, 1))
        for rank in (0, 1):
            sink.output(out(rank, "working\n", first))
            sink.output(out(rank, "giving up\n", second))
            sink.output(out(rank, "after\n", first))
        sink.flush(final=True)
    assert page == [(first, "[ranks 0-1] working\n"), (second, "[ranks 0-1] giving up\n"),
                    (first, "[ranks 0-1] after\n")], page


def test_no_merge_keeps_every_copy() -> None:
    cap = feed([out(0, "same\n"), out(1, "same\n")], merge=False)
    assert cap.stdout == "[rank 0] same\n[rank 1] same\n"


def test_identical_final_value_is_shown_once_and_different_values_per_rank() -> None:
    cap = feed([value(0, "42"), value(1, "42")])
    assert [o.data["text/plain"] for o in cap.outputs] == ["[ranks 0-1] 42"]
    cap = feed([value(0, "7"), value(1, "107")])
    assert [o.data["text/plain"] for o in cap.outputs] == ["[rank 0] 7", "[rank 1] 107"]


def test_a_line_waits_for_the_other_ranks_only_briefly() -> None:
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=(0, 1))
        sink.output(out(0, "only rank 0 so far\n"))
        sink.flush()
        assert cap.stdout == ""  # held: rank 1's copy may be on its way
        time.sleep(MERGE_HOLD_S + 0.05)
        sink.flush()
        assert cap.stdout == "[rank 0] only rank 0 so far\n"  # shown without waiting for the cell's end
        sink.output(out(1, "late\n"))
        sink.flush(final=True)
    assert cap.stdout.endswith("[rank 1] late\n")


def test_output_of_a_rank_outside_the_cell_is_shown_unmerged() -> None:
    cap = feed([out(3, "late output of an abandoned cell\n"), out(0, "x\n"), out(1, "x\n")])
    assert cap.stdout == "[rank 3] late output of an abandoned cell\n[ranks 0-1] x\n"


def test_a_line_written_in_pieces_merges_when_whole() -> None:
    cap = feed([out(0, "ab"), out(1, "abc"), out(0, "c\n"), out(1, "\n")])
    assert cap.stdout == "[ranks 0-1] abc\n"


def test_the_same_unfinished_last_line_is_merged_at_the_cells_end() -> None:
    cap = feed([out(0, "done\n"), out(1, "done\n"), out(0, "tail"), out(1, "tail")])
    assert cap.stdout == "[ranks 0-1] done\n[ranks 0-1] tail", cap.stdout  # unfinished, as printed
    cap = feed([out(0, "tail 0"), out(1, "tail 1")])  # different: each rank's own
    assert cap.stdout == "[rank 0] tail 0\n[rank 1] tail 1", cap.stdout


def test_the_rest_of_a_line_already_shown_in_part_stays_that_ranks(monkeypatch: Any) -> None:
    import clorch_repl.notebook.display as display

    monkeypatch.setattr(display, "PARTIAL_LINE_HOLD_S", 0.0)  # "step " is shown before the rest comes
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=(0, 1))
        sink.output(out(0, "step "))
        sink.flush()
        monkeypatch.setattr(display, "PARTIAL_LINE_HOLD_S", 60.0)
        sink.output(out(0, "def"))
        sink.output(out(1, "def"))
        sink.flush(final=True)
    assert cap.stdout == "[rank 0] step def\n[rank 1] def", cap.stdout  # one rank's slow line: the stream


def test_lines_written_in_pieces_by_several_ranks_at_once_stay_whole(monkeypatch: Any) -> None:
    """``print('.', end='', flush=True)`` in a loop on every rank: each rank's line, shown in part
    after its hold, was continued in the stream, where the other rank's piece had ended it, so
    each piece began a new labelled line (``[rank 0] ..`` / ``[rank 1] ..`` / ``[rank 0] ..``).
    Now each rank's line is one live display, updated as its dots come, whole at the end."""
    import clorch_repl.notebook.display as display

    monkeypatch.setattr(display, "PARTIAL_LINE_HOLD_S", 0.0)  # every flush comes later than the hold
    with capture_output() as cap:
        sink = NotebookDisplay(ranks=(0, 1))
        for pieces in ([out(0, "."), out(1, ".")], [out(0, "."), out(1, ".")], [out(1, ". done\n"), out(0, ". done\n")],
                       [out(0, "next\n"), out(1, "next\n")]):
            for piece in pieces:  # both ranks' dots within one hold, as a loop with a sleep prints them
                sink.output(piece)
            sink.flush()
        sink.flush(final=True)
    assert cap.stdout == "[ranks 0-1] next\n", cap.stdout  # no piece of a dotted line in the stream
    finals: dict[str, str] = {}
    for o in shown(cap.outputs):  # each display's last text
        finals[o.transient["display_id"]] = o.data["text/plain"]
    assert sorted(finals.values()) == ["[rank 0] ... done", "[rank 1] ... done"], finals
    # one rank alone writes in pieces into the stream, as before: nothing else can cut its line
    cap = feed([out(0, "."), out(0, "."), out(0, " done\n")], ranks=(0,))
    assert cap.stdout == "[rank 0] .. done\n" and shown(cap.outputs) == [], cap.stdout


def test_rich_output_keeps_its_place_in_each_ranks_order() -> None:
    html = {"data": {"text/html": "<b>t</b>", "text/plain": "t"}, "metadata": {}}
    items = [out(0, "before\n"), RankOutput(0, "display_data", html), out(1, "before\n"),
             RankOutput(1, "display_data", html), out(0, "after 0\n"), out(1, "after 1\n")]
    cap = feed(items)
    assert cap.stdout.startswith("[ranks 0-1] before\n[ranks 0-1]\n")  # label line above the merged HTML
    assert [o.data["text/plain"] for o in shown(cap.outputs)] == ["[ranks 0-1] t"]
    assert lines_of(cap.stdout, 0)[-1] == "after 0" and lines_of(cap.stdout, 1)[-1] == "after 1"


def test_progress_lines_stay_per_rank() -> None:
    items = [out(0, "\r 50%", "stderr"), out(1, "\r 50%", "stderr"), out(0, "\r100%\n", "stderr"),
             out(1, "\r100%\n", "stderr")]
    cap = feed(items)
    texts = {o.data["text/plain"] for o in cap.outputs}
    assert {"[rank 0] 100%", "[rank 1] 100%"} <= texts
    assert "[ranks" not in "".join(texts)


def test_lines_ending_in_carriage_return_and_newline_are_ordinary_lines() -> None:
    """A shell command in a cell (`!seq 1 3`, `!pip install`) writes "\r\n": each line was shown as
    a progress bar's display of its own, per rank, never merged (602 displays for `!seq 1 300`)."""
    cap = feed([out(0, "1\r\n2\r\n"), out(1, "1\r\n2\r\n"), out(0, "3\r\n"), out(1, "3\r\n")])
    assert cap.stdout == "[ranks 0-1] 1\n[ranks 0-1] 2\n[ranks 0-1] 3\n"
    assert shown(cap.outputs) == []
    # a progress bar's rewrites still show as one line per rank, and its last line as it ends
    cap = feed([out(0, "\r 50%"), out(0, "\r100%\r\n")], ranks=(0,))
    assert [o.data["text/plain"] for o in shown(cap.outputs)][-1:] == ["[rank 0] 100%"]


def _error(rank: int, ename: str, tb: list[str], status: Status = Status.ERROR) -> RankOutcome:
    return RankOutcome(rank, status, RankError(rank, ename, "", tuple(tb)))


def test_identical_tracebacks_are_shown_once() -> None:
    tb = ["KeyboardInterrupt", "Cell In[12], line 3", "    while True:"]
    outcome = CellOutcome(ranks={r: _error(r, "KeyboardInterrupt", tb, Status.INTERRUPTED) for r in range(4)},
                          interrupted=True)
    lines = DistributedCellError(outcome)._render_traceback_()
    assert sum("---- ranks 0-3 ----" in l for l in lines) == 1 and lines.count("Cell In[12], line 3") == 1
    assert str(DistributedCellError(outcome)) == "ranks 0-3 interrupted"
    separate = DistributedCellError(outcome, merge=False)._render_traceback_()
    assert separate.count("Cell In[12], line 3") == 4


def test_different_tracebacks_stay_per_rank() -> None:
    outcome = CellOutcome(ranks={0: _error(0, "ValueError", ["ValueError: a"]),
                                 1: _error(1, "ValueError", ["ValueError: b"])})
    text = "\n".join(DistributedCellError(outcome)._render_traceback_())
    assert "---- rank 0 ----" in text and "---- rank 1 ----" in text and "ranks 0-1" not in text


@pytest.mark.parametrize("hold", [0.0, MERGE_HOLD_S])
def test_random_interleavings_keep_every_ranks_lines_in_order(hold: float, monkeypatch: Any) -> None:
    """Whatever the chunking and the arrival order, reading the labels back gives every rank
    exactly the lines it printed, in its order (hold 0 exercises the hold-expired path)."""
    import random

    from clorch_repl.notebook import display as display_module

    monkeypatch.setattr(display_module, "MERGE_HOLD_S", hold)
    rng = random.Random(1234)
    merged_any = False
    for _ in range(150):
        ranks = tuple(range(rng.randint(2, 4)))
        common = [f"line {i}" for i in range(rng.randint(0, 6))]
        printed = {r: [l for l in common if rng.random() < 0.85] + [f"only {r}"] * rng.randint(0, 1) for r in ranks}
        for r in ranks:
            if rng.random() < 0.2:
                rng.shuffle(printed[r])
        pending = {r: "".join(l + "\n" for l in printed[r]) for r in ranks}
        items = []
        while any(pending.values()):
            r = rng.choice([r for r in ranks if pending[r]])
            cut = rng.randint(1, len(pending[r]))
            items.append(out(r, pending[r][:cut]))
            pending[r] = pending[r][cut:]
        cap = feed(items, ranks=ranks)
        for r in ranks:
            assert lines_of(cap.stdout, r) == printed[r], (printed, cap.stdout)
        merged_any = merged_any or "[ranks " in cap.stdout
    assert merged_any or hold == 0.0  # with no hold, nothing waits for a copy to merge with


def _shown(outputs: list[Any]) -> list[dict[str, Any]]:
    """What a front end shows of published displays: an update replaces the display of its id in
    place (as JupyterLab and nbclient apply update_display_data)."""
    shown: list[dict[str, Any]] = []
    for o in outputs:
        display_id = (o.get("transient") or {}).get("display_id")
        if o.get("update"):
            for i, old in enumerate(shown):
                if (old.get("transient") or {}).get("display_id") == display_id:
                    shown[i] = dict(o, update=False)
        elif not str((o.get("transient") or {}).get("display_id", "")).startswith("clorch-held-"):
            shown.append(o)  # (the empty display reserved for the held-back line is not shown)
    return shown


def test_widget_views_are_shown_in_rank_order_whatever_order_they_come_in() -> None:
    """Four ranks' tqdm.auto bars, made in the order 2, 0, 3, 1 (as a user saw them), read 0-3;
    a widget only one rank shows leaves no labels of the others; the text fallback names each."""
    view = "application/vnd.jupyter.widget-view+json"

    def bar(rank: int, n: int = 0) -> RankOutput:
        return RankOutput(rank, "display_data", {"data": {view: {"model_id": f"m{rank}-{n}", "version_major": 2},
                                                          "text/plain": f"bar {rank}"}, "metadata": {}})

    with capture_output() as cap:
        sink = NotebookDisplay(ranks=(0, 1, 2, 3))
        for item in [bar(2), bar(0), bar(2, 1), bar(3), bar(1), out(0, "done\n")]:
            sink.output(item)  # no flush: a widget view is never held for the other ranks' copies
        first = [o["data"].get(view, {}).get("model_id") for o in _shown(cap._outputs) if view in o["data"]]
        sink.flush(final=True)
    shown = _shown(cap._outputs)
    views = [o["data"][view]["model_id"] for o in shown if view in o["data"]]
    assert first == ["m0-0", "m1-0", "m2-0", "m3-0", "m2-1"]
    assert views == first
    texts = [o["data"]["text/plain"] for o in shown]
    assert texts[:8] == ["[rank 0]", "[rank 0] bar 0", "[rank 1]", "[rank 1] bar 1",
                         "[rank 2]", "[rank 2] bar 2", "[rank 3]", "[rank 3] bar 3"]
    assert texts[8:] == ["", "", "", "", "[rank 2]", "[rank 2] bar 2", "", ""]  # row 2: rank 2's only

    with capture_output() as cap:  # a clear_output between two ranks' views: the later view gets a new slot
        sink = NotebookDisplay(ranks=(0, 1))
        for item in [bar(0), RankOutput(0, "clear_output", {"wait": False}), bar(1)]:
            sink.output(item)
        sink.flush(final=True)
    assert [o["data"].get("text/plain") for o in _shown(cap._outputs)][-4:] == ["", "", "[rank 1]", "[rank 1] bar 1"]

    with capture_output() as cap:  # one rank of one: shown as it comes, as any rich output
        sink = NotebookDisplay(ranks=(1,))
        sink.output(bar(1))
        sink.flush(final=True)
    assert [o["data"]["text/plain"] for o in cap._outputs] == ["[rank 1] bar 1"]
