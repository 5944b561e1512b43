"""Every exception clorch_repl raises on purpose, in one place: the hierarchy a user catches.

::

    ClorchError (RuntimeError)          anything clorch_repl raises on purpose
    ├── ConfigError (ValueError)        bad input, refused before any process starts
    │   └── TopologyError               nproc, devices, backend or timeout refused (see spelled())
    ├── StartupError                    the ranks could not start or form their process group
    ├── RankFailure                     a batch job's rank failed (``rank``: the first, the cause)
    ├── JobTimeout (TimeoutError)       a batch job ran past its ``timeout_ms``
    ├── JobStillRunning (TimeoutError)  ``job.wait(timeout)`` ran out first; the job runs on
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
    ├── ScriptExit                      %clorch run: the script called sys.exit with a failing status
    └── UnknownRequest                  a rank was asked for a request it has no handler for

    DistributedCellError (Exception)    a ``%%distributed`` cell failed on one or more ranks

``except ClorchError`` catches the package's own failures without catching programming mistakes.
:class:`DistributedCellError` is deliberately outside it: it is the user's own code failing on the
ranks, shown with each rank's traceback, and the magics turn every ClorchError into a one-line
usage error, which would hide those tracebacks.

Messages follow one rule: say what went wrong, on which rank where there is one, and what to do
next. This module imports nothing of the package at import time but leaves of :mod:`clorch_repl.common`
(standard library only), so every other module (the notebook's, the ranks', the supervisor's) can import it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .common.human import headline
from .common.rank_sets import merge_blocks, rank_words, ranks_are

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .session.protocol import CellOutcome, RankOutcome

__all__ = ["ClorchError", "ConfigError", "TopologyError", "StartupError", "RankFailure", "JobTimeout", "JobStopped",
           "JobStillRunning", "NoProcessGroup", "CollectiveError", "CollectiveMismatch", "CollectiveTimeout",
           "CheckpointError", "SignatureError", "GroupConflict", "SpawnRefused", "ScriptNotFound", "ScriptExit",
           "UnknownRequest", "DistributedCellError"]


class ClorchError(RuntimeError):
    """Base class of every error clorch_repl raises on purpose."""


class ConfigError(ClorchError, ValueError):
    """Bad input, refused before any process starts."""


class TopologyError(ConfigError):
    """A refusal of the rank layout's checks (:func:`clorch_repl.common.topology.resolve_topology`),
    which ``%clorch start --nproc 2`` and the Python API's ``nproc=2`` share: its message is kept as
    a template naming each option by its key (``{nproc}``), so that each caller names the options
    the way its user typed them (:meth:`spelled`; the magics: ``--nproc``). ``str()`` gives the
    Python API's words. One check for both, rather than a copy of each for the magic's words."""

    def __init__(self, template: str, **values: object) -> None:
        self.template, self.values = template, values
        super().__init__(self.spelled({}))

    #: words of a template that are no option's name, as the Python API says them: ``limit``,
    #: where the work's own time limit is set (not the process group's timeout); each caller that
    #: has one names it (the magics: ``%%distributed --timeout``; ``launch()``: ``timeout_ms``)
    WORDS = {"limit": "a cell's or a job's own time limit is set apart from it"}

    def spelled(self, names: dict[str, str]) -> str:
        """The message, each option named as ``names`` says (``{"nproc": "--nproc"}``); an option
        that ``names`` leaves out keeps its own name (the Python API's)."""
        return self.template.format_map(_OwnNames({**self.WORDS, **names, **self.values}))

    def naming(self, **names: str) -> TopologyError:
        """The same refusal with some options named for good, whoever says it later: an API whose
        parameter is ``timeout_s`` (``naming(timeout="timeout_s")``), or a value that came from
        the environment, not an option (``naming(nproc="$CLORCH_NPROC")``)."""
        template = self.template
        for key, name in names.items():
            template = template.replace("{%s}" % key, name.replace("{", "{{").replace("}", "}}"))
        return TopologyError(template, **self.values)

    def __reduce__(self) -> tuple[Any, ...]:
        # the template and its values, not the message: unpickled (a job's error sent back from a
        # worker) it must still name the options as its reader's caller does
        return (_topology_error, (self.template, dict(self.values)))


def _topology_error(template: str, values: dict[str, object]) -> TopologyError:
    return TopologyError(template, **values)


class _OwnNames(dict):  # type: ignore[type-arg]
    """A template's words: an option not named otherwise is said by its key."""

    def __missing__(self, key: str) -> str:  # only option names are left out: every value is given
        return key


class StartupError(ClorchError):
    """The ranks could not be started or could not form their process group; ``outcome`` holds
    the ranks' own failures when they got as far as running code."""

    def __init__(self, message: str, outcome: CellOutcome | None = None) -> None:
        super().__init__(message)
        self.outcome = outcome


class StartInterrupted(KeyboardInterrupt):
    """The user interrupted a start (or a restart's start): every rank it had started was stopped
    again before this was raised. A ``KeyboardInterrupt`` still, so that a script's Ctrl-C ends it
    as ever; the notebook shows :attr:`message` instead of a traceback from wherever the interrupt
    happened to land (inside ZeroMQ's poll, an import). ``left``: what outlived that stop, as
    :meth:`Session.stop` reports it (normally nothing)."""

    def __init__(self, left: list[str], what: str = "start") -> None:
        super().__init__()
        self.left = list(left)
        self.what = what  # "start" or "restart": what the user was waiting for

    @property
    def message(self) -> str:
        if not self.left:
            return (f"the {self.what} was interrupted: every rank and warm spare it had started was stopped, "
                    "nothing is left running (%clorch start starts afresh)")
        return (f"the {self.what} was interrupted: its ranks were stopped, but these outlived the stop: "
                + "; ".join(self.left))


class RankFailure(ClorchError):
    """One or more ranks failed; ``rank`` is the first that failed (the cause, not the cascade)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class JobTimeout(ClorchError, TimeoutError):
    """A batch job ran past its ``timeout_ms`` and was stopped."""


class JobStillRunning(ClorchError, TimeoutError):
    """``job.wait(timeout)`` ran out of time before the job ended; the job keeps running."""


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


class ProtocolMismatch(ClorchError):
    """The notebook and a rank (or a nanny) speak different versions of the wire contract
    (:mod:`clorch_repl.wire`): different clorch_repl installs; the message names both versions."""


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

    def _render_traceback_(self) -> list[str]:
        """One line, as IPython shows it: the script's own frames end at sys.exit, which says
        nothing the line does not (a traceback header with no frames under it did)."""
        return [f"{_RED}ScriptExit{_RESET}: {self}"]


class UnknownRequest(ClorchError):
    """A rank was asked for a request (:mod:`clorch_repl.kernel.requests`) it has no handler for,
    or with arguments its handler does not take: the notebook and the rank run different
    versions of clorch_repl."""


_RED, _BOLD, _RESET = "\x1b[31m", "\x1b[1m", "\x1b[0m"


def _failure_key(result: RankOutcome, merge: bool, stacks: bool = True) -> object:
    """What makes two failed ranks' blocks the same block: the identical traceback (an interrupt's
    KeyboardInterrupt at the same line on every rank), the same stack of a stuck rank once thread
    addresses are gone, or a return after the interrupt; a death is always its own (its log
    differs). Unequal keys for everything under ``--no-merge``."""
    from .host.rankfiles import report_stack
    from .session.protocol import Status

    if not merge or result.status is Status.DIED:
        return ("rank", result.rank)
    if getattr(result, "freed", False) and result.status is not Status.STUCK:
        return ("freed",)  # its block is one sentence, whatever the abort made it raise
    if result.error is not None and result.status in (Status.ERROR, Status.INTERRUPTED):
        err = result.error
        return (result.status, err.ename, err.evalue, tuple(err.traceback))
    if result.status is Status.STUCK:  # its stack is part of its block only where stacks are shown
        return (result.status, tuple(report_stack(result.stack or "")) if stacks else ())
    if result.status is Status.RETURNED:
        return (result.status,)
    return ("rank", result.rank)


def _failure_groups(failed: list[RankOutcome], merge: bool,
                    stacks: bool = True) -> list[tuple[tuple[int, ...], RankOutcome]]:
    """Failed ranks, ranks with the same block together (:func:`_failure_key`), in the order of
    each group's lowest rank, so that four ranks stuck in one all_reduce read as one block and the
    rank that differs stands out. ``stacks``: whether a stuck rank's block shows its stack (not
    where the verdict's evidence above shows every rank's: its blocks are then one sentence)."""
    by_rank = {o.rank: o for o in failed}
    groups = merge_blocks([(o.rank, _failure_key(o, merge, stacks)) for o in failed])
    return [(ranks, by_rank[ranks[0]]) for ranks, _ in groups]


def _partial_restart(ranks: list[int], world_size: int = 0, waiting: list[int] | None = None) -> str:
    """What to type next about ``ranks`` that died or are stuck, in the notebook's words (this
    report is rendered by IPython): a restart of those ranks alone comes first, because it keeps
    every other rank's variables (the model that took minutes to load); a whole restart does not,
    and is the only advice when ``ranks`` are all ``world_size`` of the session's. ``waiting``:
    other stuck ranks, waiting in a collective for ``ranks``, which that restart frees (the
    group's abort) and which keep their variables too.
    (The magics' words, as clorch_repl.notebook.hooks.NotebookHooks.verbs has them: this module is
    below the notebook's and may not import it.)"""
    chosen = sorted(set(ranks))
    if world_size and len(chosen) >= world_size:
        return "%clorch restart starts every rank afresh and forms the group again (their variables are gone)."
    one = len(chosen) == 1
    listed = ",".join(str(r) for r in chosen)
    freed = ""
    if waiting:
        many = len(set(waiting)) > 1
        freed = (f"; {rank_words(sorted(set(waiting)))}, waiting in a collective for {'it' if one else 'them'}, "
                 f"{'are' if many else 'is'} freed and {'keep their' if many else 'keeps its'} variables")
    return (f"%clorch restart --ranks {listed} starts {'it' if one else 'them'} afresh and forms the group "
            f"again while the others keep their variables{freed}; %clorch restart starts every rank afresh.")


class DistributedCellError(Exception):
    """A ``%%distributed`` cell failed on one or more ranks.

    IPython shows ``_render_traceback_`` instead of a Python traceback, so the notebook shows each
    failed rank's own traceback (and nothing from inside clorch_repl), and the cell is marked failed.
    Ranks that failed with the identical traceback are shown once, under ``---- ranks 0-7 ----``,
    unless ``merge`` is false. Not a :class:`ClorchError` (see the module's docstring).
    """

    def __init__(self, outcome: CellOutcome, timeout_s: float | None = None, merge: bool = True) -> None:
        self.outcome, self.timeout_s, self.merge = outcome, timeout_s, merge
        super().__init__(self.summary())

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(o.rank for o in self.outcome.failed)

    def summary(self) -> str:
        from .session.protocol import Status

        parts = []
        # deaths of one cause are one part here (their blocks below stay per rank: their logs differ)
        dead: dict[str | None, list[int]] = {}
        for o in self.outcome.failed:
            if o.status is Status.DIED:
                dead.setdefault(o.exit, []).append(o.rank)
        for ranks, result in _failure_groups(self.outcome.failed, self.merge):
            who = rank_words(ranks)
            if result.status is Status.DIED:
                if result.rank == min(dead.get(result.exit, [result.rank])):
                    parts.append(f"{rank_words(dead.get(result.exit, ranks))} died ({result.exit})")
            elif result.freed and result.status is not Status.STUCK:  # as its block says: not "interrupted"
                parts.append(f"{who} freed from a collective by aborting the group")
            elif result.status is Status.STUCK and self.outcome.cut_short:  # (it may have returned since)
                parts.append(f"{who} had not returned when the wait was cut short")
            elif result.status is Status.STUCK:
                parts.append(f"{who} did not return after the interrupt")
            elif result.status is Status.INTERRUPTED:
                cause = self._stopped_after()
                parts.append(f"{who} interrupted" + (f" by clorch after {cause}" if cause else ""))
            elif result.status is Status.RETURNED:
                parts.append(f"{who} returned after the interrupt")
            elif result.error is not None:  # one line: the whole message is in the traceback
                parts.append(f"{who}: {result.error.ename}: {headline(result.error.evalue)}")
        if self.outcome.timed_out:
            parts.insert(0, f"the cell timed out after {self.timeout_s:g} s (the ranks were interrupted"
                            f"{self._grace_said()})")
        elif self.outcome.interrupted and not parts:
            parts.append("interrupted")
        if self._why_shown():  # the verdict's sentence: where a plain-text consumer sees only this
            parts.append(f"why: {self.outcome.diagnosis.splitlines()[0]}")
        if self.outcome.recovery:
            parts.append(self.outcome.recovery.removeprefix("clorch: "))
        return "; ".join(parts) or "the cell failed"

    def _stopped_after(self) -> str:
        """Why clorch interrupted ranks the user did not ("" when the user did, or a time limit):
        "rank 0 failed" (raised or died), said beside their bare KeyboardInterrupts (a try-out)."""
        from .session.protocol import Status

        if self.outcome.interrupted or self.outcome.timed_out:
            return ""
        first = [o.rank for o in self.outcome.failed if o.status in (Status.ERROR, Status.DIED) and not o.freed]
        return f"{rank_words(first)} failed" if first else ""

    def _grace_said(self) -> str:
        """Why a cell with ``--timeout 2`` can end seconds later: the interrupt's grace period."""
        grace = self.outcome.interrupt_grace_s
        return f" and given {grace:g} s more to return" if grace > 0 else ""

    def _why_shown(self) -> bool:
        """Whether the report says why: only when some rank did not come back by itself (stuck
        after the interrupt, dead, or freed by aborting the group). A cell whose ranks all returned
        to the interrupt (a flood ended by its timeout) was slow, not hung: where it was before
        the interrupt says nothing more than its own traceback does. Nor when every failed rank
        died: the verdict ("ranks 0-1 died") would repeat the report's own lines."""
        from .session.protocol import Status

        failed = self.outcome.failed
        return (bool(self.outcome.diagnosis) and any(
            o.status in (Status.STUCK, Status.DIED) or getattr(o, "freed", False) for o in failed)
            # ranks that only died: the verdict would say just that again
            and not all(o.status is Status.DIED for o in failed))

    def _render_traceback_(self) -> list[str]:
        from .common.human import wrap
        from .host.rankfiles import report_stack
        from .session.protocol import Status

        def say(text: str) -> None:  # clorch's prose, wrapped at the cell's width between words
            lines.extend(wrap(text, indent="  ").splitlines())

        lines: list[str] = []
        if self.outcome.timed_out:
            say(f"{_RED}{_BOLD}Timed out{_RESET} after {self.timeout_s:g} s; the ranks were interrupted"
                f"{self._grace_said()}.")
        why = self._why_shown()
        if why:  # why the ranks were stuck: the verdict (unless the live notice said it), each rank's evidence
            verdict, *evidence = (self.outcome.diagnosis or "").splitlines()
            if verdict != self.outcome.noticed:
                say(f"{_BOLD}Why:{_RESET} {verdict}")
            elif evidence:
                lines.append("Where each rank was (the notice above says why):")
            lines.extend(evidence)
        for ranks, result in _failure_groups(self.outcome.failed, self.merge, stacks=not why):
            who = rank_words(ranks)
            one = len(ranks) == 1
            lines.append(f"{_BOLD}---- {who} ----{_RESET}")
            if result.status is Status.DIED:
                lines.append(f"{_RED}rank {result.rank} died{_RESET}: {result.exit}.")
                if result.log_tail:
                    lines.append("Last lines of its log:")
                    lines.extend("    " + line for line in result.log_tail.rstrip().splitlines())
            elif result.status is Status.STUCK and self.outcome.cut_short:
                # as the wait ended, not as it is now: the session may have freed it since (below)
                say(f"{_RED}{who} had not returned{_RESET} when an interrupt from the notebook ended the wait "
                    "early, before the grace period was over"
                    + ("; what the session did then is below." if self.outcome.recovery else "."))
            elif result.status is Status.RETURNED:
                logs = " or ".join(f"%clorch logs {r}" for r in ranks)
                say(f"{who} returned after the interrupt: {'it is' if one else 'they are'} idle, not running this "
                    f"cell, but {'its reply' if one else 'their replies'} had not reached the notebook when the "
                    f"wait ended (an error, if any, is in the log: {logs}). {'It takes' if one else 'They take'} "
                    "the next cell at once.")
            elif result.freed and result.status is not Status.STUCK:
                say(f"{who} waited in the collective and {'was' if one else 'were'} freed by aborting the session's "
                    "group (what it raised then is the abort's, not the code's).")
            elif result.status is Status.STUCK:
                say(f"{_RED}{who} did not return{_RESET} after the interrupt: still in the cell's code, in native "
                    "code that an interrupt does not reach (a collective waiting for another rank), or in code "
                    "that caught the KeyboardInterrupt and went on.")
                stack = report_stack(result.stack or "")
                if stack and not why:  # the evidence above already shows where they are
                    lines.append("Where it is now:" if one else "Where they are now (the same stack on each):")
                    lines.extend("    " + line for line in stack)
            elif result.error is not None:
                if (cause := self._stopped_after()) and result.status is Status.INTERRUPTED:
                    say(f"{who} {'was' if one else 'were'} interrupted by clorch, not by you: {cause}, and the other "
                        "ranks are stopped soon after a rank fails (in SPMD code they most likely wait for it). "
                        "Where the interrupt landed:")
                lines.extend(result.error.traceback or [f"{result.error.ename}: {result.error.evalue}"])
        dead = [o.rank for o in self.outcome.failed if o.status is Status.DIED]
        stuck = [o.rank for o in self.outcome.failed if o.status is Status.STUCK]
        if self.outcome.recovery:  # the group was aborted: what the session did about it says what is next
            say(f"{_BOLD}{self.outcome.recovery}{_RESET}")
            return lines
        size = self.outcome.world_size
        if self.outcome.instead_of_replacing and (dead or stuck):  # never the restart it would refuse
            say(f"{rank_words(dead + stuck).capitalize()} cannot take cells: {self.outcome.instead_of_replacing}.")
            return lines
        if dead:
            say(f"The process group is broken: {rank_words(dead)} died. {_partial_restart(dead, size)}")
        if stuck:
            # ranks in their own code, where the others wait in a collective for them: restart those
            own = [o.rank for o in self.outcome.failed if o.status is Status.STUCK and o.outside_collective]
            culprits = own if own and len(own) < len(stuck) else stuck
            say(f"{ranks_are(stuck).capitalize()} still running this cell and "
                f"{'takes' if len(set(stuck)) == 1 else 'take'} no other cell. "
                f"{_partial_restart(culprits, size, [r for r in stuck if r not in culprits])}")
        return lines
