"""Every exception clorch_repl raises on purpose, in one place: the hierarchy a user catches.

::

    ClorchError (RuntimeError)          anything clorch_repl raises on purpose
    ├── ConfigError (ValueError)        bad input, refused before any process starts
    ├── StartupError                    the ranks could not start or form their process group
    ├── RankFailure                     a batch job's rank failed (``rank``: the first, the cause)
    ├── JobTimeout (TimeoutError)       a batch job ran past its ``timeout_ms``
    ├── JobStopped                      a batch job was ended by ``job.stop()``
    ├── NoProcessGroup                  a collective outside any process group
    ├── CollectiveError                 a collective failed
    │   ├── CollectiveMismatch          ranks called it with tensors that do not fit together
    │   └── CollectiveTimeout (TimeoutError)
    ├── CheckpointError                 a checkpoint could not be written, read, or does not fit
    ├── SignatureError (ValueError)     a message from a rank was unsigned, wrongly signed or replayed
    ├── GroupConflict (ConfigError)     a rank's init_process_group() disagrees with the session's group
    ├── SpawnRefused                    code on a rank asked torch.multiprocessing to start ranks of its own
    ├── ScriptNotFound (ConfigError)    %clorch run: the script or module is not there on a rank
    └── ScriptExit                      %clorch run: the script called sys.exit with a failing status

    DistributedCellError (Exception)    a ``%%distributed`` cell failed on one or more ranks

``except ClorchError`` catches the package's own failures without catching programming mistakes.
:class:`DistributedCellError` is deliberately outside it: it is the user's own code failing on the
ranks, shown with each rank's traceback, and the magics turn every ClorchError into a one-line
usage error, which would hide those tracebacks.

Messages follow one rule: say what went wrong, on which rank where there is one, and what to do
next. This module imports nothing of the package at import time, so every other module (the
notebook's, the ranks', the supervisor's) can import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from collections.abc import Iterable

    from .session.protocol import CellOutcome, RankOutcome

__all__ = ["ClorchError", "ConfigError", "StartupError", "RankFailure", "JobTimeout", "JobStopped",
           "NoProcessGroup", "CollectiveError", "CollectiveMismatch", "CollectiveTimeout", "CheckpointError",
           "SignatureError", "GroupConflict", "SpawnRefused", "ScriptNotFound", "ScriptExit",
           "DistributedCellError"]


def rank_words(ranks: "Iterable[int]") -> str:
    """``rank 1``, ``ranks 0,2`` or ``ranks 0-7``: how messages name ranks (never a Python list)."""
    from .session.display import ranks_text

    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {ranks_text(ordered)}"


def ranks_are(ranks: "Iterable[int]") -> str:
    """``rank 1 is`` or ``ranks 0,2 are``: :func:`rank_words` with its verb."""
    words = rank_words(ranks)
    return f"{words} {'are' if words.startswith('ranks') else 'is'}"


class ClorchError(RuntimeError):
    """Base class of every error clorch_repl raises on purpose."""


class ConfigError(ClorchError, ValueError):
    """Bad input, refused before any process starts."""


class StartupError(ClorchError):
    """The ranks could not be started or could not form their process group; ``outcome`` holds
    the ranks' own failures when they got as far as running code."""

    def __init__(self, message: str, outcome: CellOutcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome


class RankFailure(ClorchError):
    """One or more ranks failed; ``rank`` is the first that failed (the cause, not the cascade)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class JobTimeout(ClorchError, TimeoutError):
    """A batch job ran past its ``timeout_ms`` and was stopped."""


class JobStopped(ClorchError):
    """A batch job was ended by ``job.stop()`` before its ranks finished."""


class NoProcessGroup(ClorchError):
    """A collective was called outside any process group."""


class CollectiveError(ClorchError):
    """A collective failed; the message says which one, on which rank, and what to look at."""


class CollectiveMismatch(CollectiveError):
    """Ranks called a collective with tensors that do not fit together.

    ``ranks`` lists the ranks whose call differs from the others (empty when the problem was found
    locally, before anything was sent).
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks


class CollectiveTimeout(CollectiveError, TimeoutError):
    """``work.wait(timeout=...)`` ran out, or the process group's own timeout expired."""


class CheckpointError(ClorchError):
    """A checkpoint could not be written, read, or does not fit what it is loaded into."""


class SignatureError(ClorchError, ValueError):
    """A message from a rank was unsigned, wrongly signed or replayed."""


class GroupConflict(ConfigError):
    """``init_process_group(...)`` on a rank asked for a group other than the session's (a
    backend, world size, rank, rendezvous or device that differs); the message names each."""


class SpawnRefused(ClorchError):
    """``torch.multiprocessing.spawn``/``start_processes`` on a rank, refused before any process
    started: the rank already is one of the world's processes."""


class ScriptNotFound(ConfigError):
    """``%clorch run``: the script file or module does not exist on a rank (its host, its working
    directory); nothing ran on any rank."""


class ScriptExit(ClorchError):
    """``%clorch run``: the script ended with ``sys.exit(status)``, status neither 0 nor None;
    ``status`` is the process exit status it would have had (1 for a message)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


_RED, _BOLD, _RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


def _failure_groups(failed: list[RankOutcome], merge: bool) -> list[tuple[tuple[int, ...], RankOutcome]]:
    """Failed ranks, ranks with the identical traceback together (an interrupt's KeyboardInterrupt
    at the same line on every rank is shown once); deaths and stuck ranks always per rank."""
    from .session.protocol import Status

    groups: dict[object, list[RankOutcome]] = {}
    for result in sorted(failed, key=lambda o: o.rank):
        if merge and result.error is not None and result.status in (Status.ERROR, Status.INTERRUPTED):
            err = result.error
            key: object = (result.status, err.ename, err.evalue, tuple(err.traceback))
        else:
            key = ("rank", result.rank)
        groups.setdefault(key, []).append(result)
    return [(tuple(o.rank for o in members), members[0]) for members in groups.values()]


class DistributedCellError(Exception):
    """A ``%%distributed`` cell failed on one or more ranks.

    IPython shows ``_render_traceback_`` instead of a Python traceback, so the notebook shows each
    failed rank's own traceback (and nothing from inside clorch_repl), and the cell is marked failed.
    Ranks that failed with the identical traceback are shown once, under ``---- ranks 0-7 ----``,
    unless ``merge`` is false. Not a :class:`ClorchError` (see the module's docstring).
    """

    def __init__(self, outcome: CellOutcome, timeout_s: float | None = None, merge: bool = True) -> None:
        self.outcome = outcome
        self.timeout_s = timeout_s
        self.merge = merge
        super().__init__(self.summary())

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(o.rank for o in self.outcome.failed)

    def summary(self) -> str:
        from .session.display import ranks_text
        from .session.protocol import Status

        parts = []
        for ranks, result in _failure_groups(self.outcome.failed, self.merge):
            who = "rank" if len(ranks) == 1 else "ranks"
            who = f"{who} {ranks_text(ranks)}"
            if result.status is Status.DIED:
                parts.append(f"{who} died ({result.exit})")
            elif result.status is Status.STUCK:
                parts.append(f"{who} did not return after the interrupt")
            elif result.status is Status.INTERRUPTED:
                parts.append(f"{who} interrupted")
            elif result.status is Status.RETURNED:
                parts.append(f"{who} returned after the interrupt")
            elif result.error is not None:
                parts.append(f"{who}: {result.error.ename}: {result.error.evalue}")
        if self.outcome.timed_out:
            parts.insert(0, f"the cell timed out after {self.timeout_s:g} s (the ranks were interrupted"
                            f"{self._grace_said()})")
        elif self.outcome.interrupted and not parts:
            parts.append("interrupted")
        if self.outcome.diagnosis:  # the verdict's sentence: where a plain-text consumer sees only this
            parts.append(f"why: {self.outcome.diagnosis.splitlines()[0]}")
        return "; ".join(parts) or "the cell failed"

    def _grace_said(self) -> str:
        """Why a cell with ``--timeout 2`` can end seconds later: the interrupt's grace period."""
        grace = self.outcome.interrupt_grace_s
        return f" and given {grace:g} s more to return" if grace > 0 else ""

    def _render_traceback_(self) -> list[str]:
        from .session.display import ranks_text
        from .session.protocol import Status

        lines: list[str] = []
        if self.outcome.timed_out:
            lines.append(f"{_RED}{_BOLD}Timed out{_RESET} after {self.timeout_s:g} s; the ranks were interrupted"
                         f"{self._grace_said()}.")
        if self.outcome.diagnosis:  # why the ranks were stuck: the verdict, then each rank's evidence
            verdict, *evidence = self.outcome.diagnosis.splitlines()
            lines.append(f"{_BOLD}Why:{_RESET} {verdict}")
            lines.extend(evidence)
        for ranks, result in _failure_groups(self.outcome.failed, self.merge):
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"
            lines.append(f"{_BOLD}---- {who} ----{_RESET}")
            if result.status is Status.DIED:
                lines.append(f"{_RED}rank {result.rank} died{_RESET}: {result.exit}.")
                if result.log_tail:
                    lines.append("Last lines of its log:")
                    lines.extend("    " + line for line in result.log_tail.rstrip().splitlines())
            elif result.status is Status.STUCK and self.outcome.cut_short:
                lines.append(f"{_RED}rank {result.rank} had not returned{_RESET} when an interrupt from the "
                             "notebook ended the wait early, before the grace period was over.")
            elif result.status is Status.RETURNED:
                lines.append(f"rank {result.rank} returned after the interrupt: it is idle in its event loop, "
                             "not running this cell, but its reply had not reached the notebook when the wait "
                             f"ended (its error, if any, is in its log: %clorch logs {result.rank}). It takes "
                             "the next cell at once.")
            elif result.status is Status.STUCK:
                lines.append(f"{_RED}rank {result.rank} did not return{_RESET} within the grace period after "
                             "being interrupted and is stuck: its stack shows it still in the cell's code "
                             "(native code such as a collective waiting for another rank), or its code caught "
                             "the KeyboardInterrupt and went on.")
                if result.stack:
                    lines.append("Where it is now:")
                    lines.extend("    " + line for line in result.stack.rstrip().splitlines())
            elif result.error is not None:
                lines.extend(result.error.traceback or [f"{result.error.ename}: {result.error.evalue}"])
        dead = [o.rank for o in self.outcome.failed if o.status is Status.DIED]
        stuck = [o.rank for o in self.outcome.failed if o.status is Status.STUCK]
        if dead:
            lines.append(f"The process group is broken: {rank_words(dead)} died. Run %clorch restart for a "
                         "fresh group (%clorch status shows each rank).")
        if stuck:
            lines.append(f"{ranks_are(stuck).capitalize()} still running this cell, so "
                         f"{'it takes' if len(set(stuck)) == 1 else 'they take'} no other: wait, %clorch interrupt "
                         "again, or %clorch restart for a fresh group (%clorch status shows each rank).")
        return lines
