"""A user try-out's three findings, without a process: ``%clorch top --once`` said "0 %" for busy
ranks (a CPU share asked once has no earlier sample), ``--profile /proc/nope`` gave a raw
FileNotFoundError traceback, and ``--gather get_ipython`` was accepted and broke every later
magic. Through real ranks: tests/integration/test_magic_tryout.py."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from clorch_repl.errors import ConfigError
from clorch_repl.notebook import panel
from clorch_repl.session.lifecycle import SessionState
from clorch_repl.session.panel_view import render
from clorch_repl.session.protocol import RankState
from clorch_repl.session.view import RankView, SessionView


class _Rank:
    """A rank's usage as psutil's ``cpu_percent(None)`` reports it: the share since the last
    question, 0.0 for the first (it has no earlier sample)."""

    def __init__(self, busy_pct: float) -> None:
        self.busy_pct = busy_pct
        self.asked_at: float | None = None

    def answer(self) -> dict[str, Any]:
        first, self.asked_at = self.asked_at is None, time.monotonic()
        return {"usage": {"cpu_pct": 0.0 if first else self.busy_pct, "rss": 100 << 20, "gpu": None}}


class _Prober:
    def __init__(self, ranks: dict[int, _Rank | None]) -> None:
        self.ranks = ranks
        self.asks: list[tuple[float, list[int]]] = []

    def ask(self, ranks: list[int], **_options: Any) -> dict[int, Any]:
        self.asks.append((time.monotonic(), list(ranks)))
        return {r: (self.ranks[r].answer() if self.ranks[r] is not None else None) for r in ranks}

    def close(self) -> None:
        pass


def _session(prober: _Prober) -> Any:
    view = SessionView(state=SessionState.READY, why="", generation=0, launcher="local", backend="gloo",
                       ranks=tuple(RankView(rank=r, host="", state=RankState.IDLE, exit=None, pid=1, device="cpu",
                                            started_at=0.0) for r in prober.ranks), started_at=0.0)
    return SimpleNamespace(view=lambda last_lines=False: view, relay=SimpleNamespace(new_prober=lambda: prober))


def test_once_shows_the_cpu_a_busy_rank_uses_not_the_zero_of_a_first_sample() -> None:
    prober = _Prober({0: _Rank(47.0), 1: _Rank(45.0)})
    snaps, note, verdict = panel.snapshot_once(_session(prober))
    shown = render(snaps, verdict, note=note)["text/plain"]
    assert [s.usage["cpu_pct"] for s in snaps] == [47.0, 45.0], shown
    assert "47 %" in shown and "45 %" in shown and " 0 % " not in shown, shown
    (first, _), (second, _) = prober.asks
    assert second - first >= panel.CPU_SAMPLE_S * 0.9  # measured over an interval, said in the docstring


def test_a_rank_that_did_not_answer_is_not_asked_again() -> None:
    prober = _Prober({0: _Rank(30.0), 1: None})
    answers = panel.first_answers(prober, [0, 1], pause_s=0.01)
    assert answers[0]["usage"]["cpu_pct"] == 30.0 and answers[1] is None
    assert [ranks for _, ranks in prober.asks] == [[0, 1], [0]]


def test_the_live_panels_first_draw_measures_too() -> None:
    prober = _Prober({0: _Rank(55.0), 1: _Rank(37.0)})
    shown: list[dict[str, str]] = []
    opened = panel.Panel(lambda: _session(prober), show=shown.append)
    opened._relay = None
    opened.session = _session(prober)
    opened.session.relay.add_tick = lambda tick: None
    snaps, _ = opened._attach()
    assert [s.usage["cpu_pct"] for s in snaps] == [55.0, 37.0]


def test_a_trace_folder_that_cannot_be_made_is_one_line_before_any_rank_is_asked() -> None:
    from clorch_repl.session import profile

    asked: list[str] = []
    session = SimpleNamespace(chosen=lambda ranks: asked.append("chosen") or (0, 1),
                              run=lambda *a, **k: asked.append("run"))
    with pytest.raises(ConfigError) as refused:
        profile.profiled(session, None, "/proc/nope", lambda: asked.append("cell"))
    message = str(refused.value)
    assert message.startswith("--profile /proc/nope: cannot make or write in that trace folder (")
    assert "\n" not in message and asked == []


def test_a_trace_folder_is_made_and_given_back_absolute(tmp_path: Any) -> None:
    from clorch_repl.session import profile

    made = profile.trace_folder(str(tmp_path / "a" / "b"))
    assert made == str(tmp_path / "a" / "b") and (tmp_path / "a" / "b").is_dir()
    assert list((tmp_path / "a" / "b").iterdir()) == []  # the write check leaves nothing behind


@pytest.mark.parametrize("line, message", [
    ("%%distributed --gather get_ipython\n1", "--gather 'get_ipython' is one of IPython's own names"),
    ("%%distributed --gather _3\n1", "--gather '_3' is one of IPython's own names"),
    ("%clorch pull Out", "binding it in the notebook would break IPython there"),
    ("%clorch pull exit", "choose another name"),
    ("%clorch push In", "binding it on the ranks would break IPython there"),
])
def test_a_name_ipython_keeps_is_refused(ip: Any, line: str, message: str) -> None:
    from IPython.utils.capture import capture_output

    before = ip.user_ns.get("get_ipython")
    with capture_output() as cap:
        result = ip.run_cell(line)
    said = cap.stdout + cap.stderr
    assert not result.success
    assert message in " ".join(said.split()), said
    assert "Traceback" not in said and "choose another name" in " ".join(said.split()), said
    assert ip.user_ns.get("get_ipython") is before


def test_names_a_user_picks_are_still_taken() -> None:
    from clorch_repl.session.transfer import check_name

    for name in ("out", "x", "rank", "_x", "losses", "In_", "final", "input", "sum", "id"):  # (builtins: as `=` takes them)
        assert check_name(name, "--gather") == name
