"""``%%distributed --profile [DIR]`` on the notebook's side: torch.profiler on every rank for one
cell, one merged trace, and a verdict on which rank the others waited for.

Around the cell, two silent requests (:func:`clorch_repl.wire.requests.request_code`): the rank's
:func:`clorch_repl.kernel.profiler.start` (a barrier, then the profiler) and, whatever the cell did,
its :func:`~clorch_repl.kernel.profiler.stop` (each rank writes ``DIR/rank-R.json`` and announces
its summary in a private display message, collected here). The ranks' traces are merged into
``DIR/trace.json`` (:func:`.straggler.merge_traces`: one process per rank, each rank's time zero at
the shared barrier) and the summaries give one line per rank and, when one rank computed clearly
longer than the others, one sentence naming it (:func:`.straggler.find_straggler`).

DIR must be reachable by every rank's host at the same path (a shared filesystem across hosts);
a rank's trace the notebook cannot read is named, the others are still merged. Without DIR the
traces go under the session's own directory (:func:`default_folder`), never into the notebook's
folder unasked (a ``clorch-profiles/`` folder used to appear beside the notebook). The report says
what "other" time is, and names the trace as a link a notebook opens.
"""

from __future__ import annotations

import html
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..diagnosis import straggler
from ..diagnosis.straggler import MIME
from ..errors import ClorchError, ConfigError, DistributedCellError
from ..wire.requests import request_code
from .hooks import ShowOutput, plain_output
from .protocol import CellOutcome
from .transfer import MimeCollector

logger = logging.getLogger(__name__)

__all__ = ["ProfileReport", "profiled", "default_folder", "trace_folder"]

#: Time allowed for the start (a barrier) and the stop (writing a trace) requests.
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class ProfileReport:
    """What ``--profile`` shows under the cell."""

    trace_path: str | None
    lines: tuple[str, ...]
    verdict: straggler.Straggler | None

    def text(self) -> str:
        return "\n".join(self.lines)

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _repr_html_(self) -> str:
        """The report with the merged trace as a link: relative to the notebook's folder where the
        trace is under it (JupyterLab opens it, or downloads it for Perfetto), else a file: link."""
        out = html.escape(self.text())
        if self.trace_path:
            rel = os.path.relpath(self.trace_path)
            href = rel if not rel.startswith("..") else "file://" + self.trace_path
            out = out.replace(html.escape(self.trace_path),
                              f"<a href='{html.escape(href, quote=True)}' target='_blank'>{html.escape(self.trace_path)}</a>")
        return f"<pre style='white-space:pre-wrap'>{out}</pre>"


#: What the per-rank lines call "other": a line under them says so.
OTHER = ("other: the cell's time in neither an operator nor a collective (Python between operators, data "
         "loading, sleeps, waiting on I/O)")


def default_folder(cell_number: int | None, session: Any = None) -> str:
    """``SESSION_DIR/profiles/cell-N-YYYYmmdd-HHMMSS``: where a cell's traces go when DIR is not
    given, under the session's own directory (its launcher's, where it has one on this host;
    removed with the session), else under the temporary directory; never the notebook's folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    own = getattr(getattr(session, "group", None), "dir", None)
    base = own if isinstance(own, str) and os.path.isdir(own) else os.path.join(tempfile.gettempdir(), "clorch-profiles")
    return os.path.join(base, "profiles" if base == own else "",
                        f"cell-{cell_number if cell_number is not None else 'x'}-{stamp}")


def trace_folder(folder: str) -> str:
    """``folder`` made (with its parents) and checked to take a file, as an absolute path; before
    anything is sent to a rank. A folder that cannot be made or written in is refused in one line
    saying why (``/proc/nope`` gave a raw FileNotFoundError traceback)."""
    folder = os.path.abspath(os.path.expanduser(folder))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"--profile {folder}: that is a file; give a folder for the traces")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # root passes os.access; a file must really be made
            pass
    except OSError as exc:
        why = exc.strerror or exc.__class__.__name__
        raise ConfigError(f"--profile {folder}: cannot make or write in that trace folder ({why}); "
                          "give a folder you can write in, or --profile alone for the session's own") from None
    return folder


def profiled(session: Any, ranks: list[int] | None, folder: str,
             run_cell: Callable[[], CellOutcome], *, show: ShowOutput = plain_output) -> tuple[CellOutcome, ProfileReport]:
    """Run ``run_cell`` with the profiler on every chosen rank; returns its outcome and the report
    (what the profiler's requests print goes to ``show``'s output hook)."""
    folder = trace_folder(folder)
    chosen = session.chosen(ranks)
    started = session.run(request_code("profile_start"), list(chosen), REQUEST_TIMEOUT_S,
                          show(chosen), silent=True)
    if not started.ok:
        raise ClorchError(f"--profile could not start the profiler: {DistributedCellError(started).summary()}")
    collector = MimeCollector(chosen, MIME, show)
    try:
        outcome = run_cell()
    finally:
        stopped = session.run(request_code("profile_stop", folder=folder), list(chosen), REQUEST_TIMEOUT_S,
                              collector, silent=True)
    if not stopped.ok:
        return outcome, ProfileReport(None, (f"clorch profile: stopping the profiler failed: "
                                             f"{DistributedCellError(stopped).summary()}",), None)
    return outcome, _report(folder, chosen, collector.found)


def _report(folder: str, chosen: tuple[int, ...], summaries: dict[int, dict[str, Any]]) -> ProfileReport:
    traces: dict[int, dict[str, Any]] = {}
    unread: list[str] = []
    for rank in chosen:
        summary = summaries.get(rank)
        if summary is None:
            unread.append(f"rank {rank} sent no summary")
            continue
        try:
            with open(summary["trace"], encoding="utf-8") as fh:
                traces[rank] = json.load(fh)
        except (OSError, ValueError) as exc:
            unread.append(f"rank {rank}'s trace {summary['trace']} ({exc.__class__.__name__}: {exc}; across hosts "
                          "DIR must be on a filesystem they share)")
    lines: list[str] = []
    trace_path = None
    if traces:
        trace_path = os.path.join(folder, "trace.json")
        with open(trace_path, "w", encoding="utf-8") as fh:
            json.dump(straggler.merge_traces(traces), fh)
        lines.append(f"clorch profile: one trace of {len(traces)} rank(s) in {trace_path} (Perfetto or "
                     "chrome://tracing open it; each rank is a process)")
    lines += [f"clorch profile: not merged: {u}" for u in unread]
    ranks = straggler.rank_lines(summaries)
    lines += ranks
    if any(", other " in line for line in ranks):
        lines.append(OTHER)
    verdict = straggler.find_straggler(summaries)
    if verdict is not None:
        lines.append(verdict.sentence())
    elif len(summaries) > 1:
        lines.append(f"no straggler: no rank computed {straggler.STRAGGLER_MIN_FRACTION:.0%} longer than the others")
    return ProfileReport(trace_path, tuple(lines), verdict)
