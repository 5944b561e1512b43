"""What the engine's tests share: hooks that keep every output item, and a module's session of
real gloo ranks that must leave no process behind."""

from __future__ import annotations

import contextlib
from typing import Iterator

import psutil

from clorch_repl.common.procs import wait_gone
from clorch_repl.session.engine import CellHooks, RankOutput, Session, local_session


class Lines(CellHooks):
    """Hooks that keep every output item and answer no prompts."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[RankOutput] = []

    def output(self, item: RankOutput) -> None:
        self.items.append(item)

    def text(self, rank: int, stream: str | None = None) -> str:
        """What ``rank`` printed (on ``stream`` only, when given)."""
        return "".join(i.content.get("text", "") for i in self.items if i.rank == rank and i.kind == "stream"
                       and (stream is None or i.content.get("name") == stream))


@contextlib.contextmanager
def engine_session(nproc: int = 2, first_cell: str | None = None) -> Iterator[Session]:
    """A started session of ``nproc`` gloo ranks (``first_cell`` run on every rank first); once
    stopped, every process it started is gone (checked)."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other fixtures' sessions
    engine = local_session(nproc, "gloo")
    engine.start()
    try:
        if first_cell is not None:
            assert engine.run(first_cell, None, None, None).ok
        yield engine
    finally:
        children = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
        assert engine.stop() == []
        assert wait_gone(children, 10) == []  # no process left behind
