"""Text and HTML renderings of what ``%clorch`` reports (status and jobs tables)."""

from __future__ import annotations

import html
import time
from typing import Any, Callable, Sequence

from IPython.display import display

from ..errors import ClorchError, ranks_are
from ..common.human import duration as _duration
from ..common.human import size as _bytes
from ..common.procs import exit_in_a_table
from ..common.rank_sets import rank_words
from ..launchers.base import Launcher
from ..session.rank_report import RankReport
from ..session.inspecting import kept_log_text
from ..session.session import Session
from ..notebook.hooks import NotebookHooks


def status_rows(rows: Sequence[RankReport]) -> tuple[list[str], list[list[str]]]:
    """The status table; a host column when any rank runs on another host."""
    hosts = any(row.host for row in rows)
    header = ["rank", *(["host"] if hosts else []), "state", "pid", "device", "backend", "memory", "gpu memory",
              "uptime"]
    body = []
    for row in rows:
        state = row.state.value if row.exit is None else f"{row.state.value} ({exit_in_a_table(row.exit)})"
        body.append([str(row.rank), *([row.host or "-"] if hosts else []), state, str(row.pid or "-"), row.device,
                     row.backend, _bytes(row.memory_bytes), _bytes(row.gpu_memory_bytes),
                     _duration(row.uptime_s) if row.exit is None else "-"])  # a dead rank has none ("0s" read as just started)
    return header, body


def spares_line(spares: Sequence[tuple[int | None, int | None, bool]], purpose: str = "the next %clorch restart") -> str:
    """One line under the status table: the warm spares, whether they are ready, the memory they hold."""
    known = [rss for _, rss, _ in spares if rss is not None]
    pids = ", ".join("?" if pid is None else str(pid) for pid, _, _ in spares)
    ready = sum(1 for *_, up in spares if up)
    state = "ready" if ready == len(spares) else "starting" if not ready else f"{ready} ready, the others starting"
    return (f"warm spares for {purpose}: {len(spares)} (pids {pids}), {state}, "
            f"{_bytes(sum(known)) if known else '-'} resident in all; %clorch start --spares 0 keeps none")


def saves_line(saves: dict[int, list[dict[str, object]]]) -> str | None:
    """One line under the status table per checkpoint path an asynchronous save is writing."""
    from ..errors import rank_words

    by_path: dict[str, list[tuple[int, float]]] = {}
    for rank, entries in saves.items():
        for entry in entries:
            by_path.setdefault(str(entry.get("path")), []).append((rank, float(entry.get("for_s", 0.0))))
    lines = [f"checkpoint save in flight: {path} ({rank_words(r for r, _ in ranks)}, writing for "
             f"{max(s for _, s in ranks):.0f} s); its handle's wait() returns when it is committed"
             for path, ranks in sorted(by_path.items())]
    return "\n".join(lines) if lines else None


def table_text(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    # no padding after the last column: a long last cell (a job's cause) padded every other row
    return "\n".join(line.rstrip() for line in [fmt.format(*header), *(fmt.format(*r) for r in body)])


def table_html(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in r) + "</tr>"
                   for r in body)
    return f"<table class='clorch-table'><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def table_bundle(header: list[str], body: list[list[str]]) -> dict[str, str]:
    """Both renderings: a notebook shows the HTML table, a terminal the text."""
    return {"text/plain": table_text(header, body), "text/html": table_html(header, body)}


class StartProgress:
    """One line that updates in place while ranks start (a new line per update in a terminal)."""

    def __init__(self) -> None:
        self.handle: Any = None
        #: when the command began: Session.start reports what the user waited from here (a
        #: restart said "formed in 4.6 s" after 7.4 s, its stop of the old ranks left out)
        self.since = time.monotonic()

    def __call__(self, text: str) -> None:
        bundle = {"text/plain": f"clorch: {text}"}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)


def interrupt_report(stuck: dict[int, str], verdict: str) -> str:
    """What ``%clorch interrupt`` says of ranks that did not return: each distinct stack once,
    under the ranks it is theirs (three ranks in one barrier read as one block), paths from the
    environment (rankfiles.report_stack), then the verdict, wrapped at the cell's width."""
    from ..common.human import wrap
    from ..host.rankfiles import report_stack
    from ..common.rank_sets import merge_blocks, rank_words

    lines = []
    for ranks, stack in merge_blocks([(r, tuple(report_stack(s))) for r, s in sorted(stuck.items())]):
        lines.append(wrap(f"clorch: {rank_words(ranks)} did not return after the interrupt; "
                          f"{'it is' if len(ranks) == 1 else 'they are'} here:"))
        lines.extend(stack)
    lines.append(wrap(f"clorch: why: {verdict} (%clorch why shows each rank's collectives)", indent="  "))
    return "\n".join(lines)


def interrupted(stuck: dict[int, str], recovered: str | None, why: Callable[[], str], nproc: int,
                group: Launcher | None = None) -> None:
    """What ``%clorch interrupt`` says: ranks that did not return (each one's stack, the verdict
    from ``why``) fail the command, with the restart that can help (of those ranks alone while
    some others are free, unless the session's launcher ``group`` cannot replace them: then what
    it says to do instead, :meth:`~clorch_repl.launchers.base.Launcher.instead_of_replacing`); a
    recovery's line when the group was aborted to free them."""
    if recovered:
        print(recovered)
    if not stuck:
        if not recovered:
            print("clorch: interrupted every rank; all are idle")
        return
    print(interrupt_report(stuck, why().splitlines()[0]))
    if len(stuck) == nproc:
        raise ClorchError(f"{ranks_are(stuck)} stuck: run %clorch restart for a fresh group")
    if group is not None and (advice := group.instead_of_replacing(sorted(stuck))):
        raise ClorchError(f"{ranks_are(stuck)} stuck: {advice}")
    lost = ",".join(str(r) for r in stuck)
    raise ClorchError(f"{ranks_are(stuck)} stuck: %clorch restart --ranks {lost} starts "
                      f"{'it' if len(stuck) == 1 else 'them'} afresh while the others keep their variables; "
                      "%clorch restart starts every rank afresh")


def notice(text: str | None) -> None:
    """A line of clorch's own before a cell's output (on stdout: information, not an error)."""
    if text:
        print(text)


def session_line(session: Any) -> str | None:
    """``%clorch status``'s first lines: the session's state where it is not simply ready
    (recovering, degraded), and who drives a detached one (:func:`~clorch_repl.session.reattach.held_line`)."""
    from ..session.reattach import held_line

    state, why = session.life.state.value, session.life.why
    lines = [] if state == "ready" else [f"clorch: the session is {state}" + (f": {why}" if why else "")]
    held = held_line(session)
    return "\n".join(lines + ([held] if held else [])) or None


def detached_hint() -> str:
    """Where a kernel that drives no ranks says so: this user's detached sessions on this host and
    how to reach them ("" when there are none). After Kernel > Restart the first thing typed is a
    cell or ``%clorch status``, and a plain "%clorch start" would make a second set of ranks."""
    from ..errors import ConfigError
    from ..session import registry

    here = []
    for name in registry.names():
        try:
            record = registry.read(name)
        except ConfigError:  # an unreadable file: %clorch sessions says what is wrong with it
            continue
        if registry.elsewhere(record) is None and registry.live(record):
            here.append(name)
    if len(here) == 1:
        return f"; your detached session {here[0]!r} runs on this host: %clorch connect {here[0]} drives it from here"
    if here:
        return (f"; {len(here)} detached sessions of yours run on this host ({', '.join(here)}): "
                "%clorch connect NAME drives one from here")
    return ""


def not_running() -> ClorchError:
    """The refusal of a command that needs running ranks, with the detached sessions it could drive."""
    return ClorchError("no ranks are running: run %clorch start first" + detached_hint())


def log_text(session: Session | None, kept: str, rank: int, tail: int | None, job: str | None) -> str:
    """What ``%clorch logs RANK`` shows: a batch job's rank log (``--job``), the running session's,
    or, once no ranks run, the log in ``kept``, where the last ``%clorch stop`` kept its session's
    logs (:mod:`clorch_repl.host.logfiles`), under a line saying so; ClorchError where there is none."""
    if job is not None:
        from ..jobs.batch import get_job

        return get_job(job).logs(rank, tail=tail)
    if session is not None and session.running:
        return session.logs(rank, tail)
    kept = (session.kept_logs if session is not None else "") or kept  # (a failed restart's stop kept them)
    if not kept:
        raise not_running()
    return kept_log_text(kept, rank, tail, NotebookHooks.verbs)
