"""The engine's hooks: what a session asks of the program that drives it (issue 33).

Why hooks: a session (start, run a cell, interrupt, status, stop) is driven by the notebook's
magics, by ``clorch-release-check``, by scripts and by agents, and only the first runs inside
IPython. So the session asks whoever drives it, in the manner of jupyter_client's
``execute_interactive`` (its ``output_hook`` and ``stdin_hook``), and never imports IPython:

* a cell's output goes to an output hook (:class:`~clorch_repl.session.sink.OutputSink`:
  ``output``, ``flush``, ``comm``, ``notice``; :class:`~clorch_repl.session.sink.PlainSink`
  gives defaults);
* a rank's ``input()``, ``getpass`` or ``breakpoint()`` prompt goes to a :class:`StdinHook`
  (override :meth:`StdinHook.answer` for a blocking answer, as a script or an agent gives one);
  :class:`NoStdin` says why a cell's ranks may not ask (their ``input()`` then raises, saying so);
* :class:`CellHooks` is both in one object, the usual thing to pass to ``Session.run``;
* what lives between cells, in the driving process, is a :class:`SessionHooks`: where the ranks'
  widget (comm) messages go, what to do while a cell is waited for and after it, and JupyterLab's
  debugger panel. The base class offers none of it (plain Python); the notebook's
  implementation is :class:`clorch_repl.notebook.hooks.NotebookHooks`.

What holds for every hook: it is called on the thread that called ``run`` (or ``finish``), the
session's own (see ``Session.interrupt``, the one method other threads may call), never on
another. A hook that raises during a cell's wait (an output hook's ``output``, ``flush``,
``comm``, ``notice``; a stdin hook's ``answer``, ``open``, ``poll``, ``cancel``;
``SessionHooks.waiting``) ends the wait there: the cell is abandoned as a timed-out one is (it
runs on to its end on the ranks, which refuse the next cell till then, unless interrupted; its
later output is dropped and counted, never given to the next cell) and the exception leaves
``run``. A KeyboardInterrupt from a hook interrupts the cell, as Ctrl-C does. ``cell_ended``
runs once the cell is over: when it raises after a cell that raised, it is logged and the
cell's own exception is the one that leaves ``run``.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, ContextManager, Mapping, Protocol

from ..common.user_frames import users_stacklevel
from ..errors import ClorchError
from .protocol import RankOutput
from .sink import OutputSink, PlainSink

logger = logging.getLogger(__name__)

__all__ = ["CellHooks", "NoStdin", "OutputSink", "PlainSink", "RankOutput", "SessionHooks", "ShowOutput",
           "StdinHook", "SCRIPT_VERBS", "Verbs", "WidgetHook", "plain_output", "stdin_of"]

#: The answer that makes a rank's ``input()`` raise EOFError (what Ctrl-D is at a terminal).
END_OF_FILE = "\x04"


@dataclass(frozen=True)
class Verbs:
    """How the engine's refusals name what the user can do next, and the options they refuse, in
    the words of whoever drives the session: a script calls the session's methods and passes their
    parameters (:data:`SCRIPT_VERBS`), the notebook's user types magics and their options
    (:class:`clorch_repl.notebook.hooks.NotebookHooks` gives those)."""

    interrupt: str = "session.interrupt()"
    restart: str = "session.restart()"
    #: a restart of some ranks only; ``{ranks}``: their numbers, comma-separated
    restart_ranks: str = "session.restart(ranks=[{ranks}])"
    #: the step that starts the ranks, said as an imperative (``... running: {to_start} first``)
    to_start: str = "call session.start()"
    #: how a cell's options are named: its ranks, the ranks whose prompts reach the front end,
    #: its own time limit (``Session.run``'s parameters)
    ranks: str = "ranks"
    stdin_ranks: str = "stdin_ranks"
    #: what a rank left out of a cell's ``stdin_ranks`` says when it asks for input: ``{allowed}``,
    #: the ranks that may; ``{rank}``, the one asking (filled in on the rank). The rank's
    #: ``breakpoint()`` says the same, its last words ("to answer its prompts ...") replaced
    stdin_refused: str = ("only {allowed} may read input in this cell (session.run's stdin_ranks); add rank {rank} "
                          "to stdin_ranks to answer its prompts through the stdin hook")
    timeout: str = "timeout_s"
    #: a cell's own hang notice (seconds; 0: off)
    hang_notice: str = "hang_notice_s"
    #: a restart of some ranks, none named yet ("... or {restart_some} first")
    restart_some: str = "session.restart(ranks=...)"
    start: str = "session.start()"
    stop: str = "session.stop()"
    status: str = "session.status()"
    suspend: str = "session.suspend()"
    resume: str = "session.resume()"
    why: str = "session.why()"
    #: the option of ``why`` that picks the ranks whose evidence is shown
    why_ranks: str = "ranks"
    #: JupyterLab's debugger panel pointed at a rank (what names a rank out of range, too)
    debugger: str = "session.debug_rank()"
    #: what names the rank whose log is read (a rank out of range is refused in its name)
    logs: str = "session.logs()"


#: the engine's words: a script calls the session's methods and names ``Session.run``'s parameters
SCRIPT_VERBS = Verbs()


@dataclass(frozen=True)
class NoStdin:
    """A cell whose ranks may not ask for input, and why (shown by a rank's ``input()``, which
    raises at once instead of waiting for an answer nobody will give)."""

    why: str


#: why a cell run without any stdin hook may not ask (``stdin=None`` and an output hook that
#: answers no prompts)
NO_STDIN_HOOK = "this cell was run without a stdin hook"


class StdinHook:
    """Answers the prompts of a cell's ranks (``input()``, ``getpass``, ``breakpoint()``'s pdb).

    The contract, in the session's order: one prompt is open at a time; requests that arrive
    together are served in rank order. :meth:`open` opens a prompt, then :meth:`poll` is called
    on every pass of the relay's loop until it returns the line (the other ranks' output keeps
    streaming, deaths and the time limit are still noticed meanwhile); :meth:`cancel` closes a
    prompt whose rank stopped waiting (interrupted or dead): a late answer to it must be dropped.

    The default :meth:`open` calls :meth:`answer`, which blocks: a script overrides only that (as
    jupyter_client's ``stdin_hook`` answers an ``input_request``). While a blocking ``answer``
    runs it holds the relay's loop: the other ranks' output waits, and an interrupt, a death or
    the time limit is noticed only once it returns (an interrupt then drops the answer and the
    prompts queued meanwhile). A hook that must not hold the loop (an agent asking elsewhere, the
    notebook's front end) overrides :meth:`open` (send the question, return at once), :meth:`poll`
    and :meth:`cancel` instead, and sets :attr:`socket` so that the relay's poll wakes when the
    answer arrives. Every method is called on the thread that runs the cell."""

    #: a ZeroMQ socket the relay's poll watches while a prompt is open (None: no wake-up needed)
    socket: Any = None
    #: the default open()'s answer until poll() takes it (a class default: subclasses need not
    #: call this class's __init__)
    _answered: str | None = None

    def answer(self, rank: int, prompt: str, password: bool) -> str:
        """The line for ``rank``'s prompt (without its newline); raise EOFError for end-of-file
        (the rank's ``input()`` raises EOFError). ``password``: the rank asked with getpass, so
        the line must not be echoed. Any other exception leaves ``run`` as an output hook's does
        (see the module docstring: the cell is abandoned, still running on the ranks, and
        ``interrupt`` ends it)."""
        raise NotImplementedError(f"{type(self).__name__} answers no prompts: override answer() (or open() and "
                                  "poll()), or run the cell with NoStdin")

    def open(self, rank: int, prompt: str, password: bool) -> None:
        """A prompt of ``rank`` opens; its answer is what :meth:`poll` returns next."""
        try:
            self._answered = self.answer(rank, prompt, password)
        except EOFError:
            self._answered = END_OF_FILE

    def poll(self) -> str | None:
        """The open prompt's answer if it has come, None while it has not."""
        answered, self._answered = self._answered, None
        return answered

    def cancel(self) -> None:
        """The open prompt's rank stopped waiting (or no prompt is open): drop a late answer."""
        self._answered = None


class CellHooks(PlainSink, StdinHook):
    """A cell's hooks in one object: output (:class:`~clorch_repl.session.sink.OutputSink`, here
    with PlainSink's defaults: override :meth:`output`) and prompts (:class:`StdinHook`: override
    :meth:`answer`; without it, a rank's ``input()`` raises, naming this class)."""

    def answers_prompts(self) -> bool:
        """Whether this class answers prompts (overrides answer or open): when it does not, the
        ranks are told so before they ask, rather than left waiting."""
        cls = type(self)
        return cls.answer is not StdinHook.answer or cls.open is not StdinHook.open


def stdin_of(sink: object, stdin: StdinHook | NoStdin | None) -> StdinHook | NoStdin:
    """The stdin a cell gets: ``stdin`` as given; or, for None, the output hook itself when it
    answers prompts (a :class:`CellHooks` that overrides ``answer``), else :class:`NoStdin`."""
    if stdin is not None:
        return stdin
    if isinstance(sink, CellHooks) and sink.answers_prompts():
        return sink
    if sink is None:
        return NoStdin(f"{NO_STDIN_HOOK} (pass stdin=, or hooks that answer prompts: a CellHooks that "
                       "overrides answer())")
    return NoStdin(f"{NO_STDIN_HOOK} ({type(sink).__name__} answers no prompts: pass stdin=, or a CellHooks "
                   "that overrides answer())")


class ShowOutput(Protocol):
    """Makes the output hook of one of clorch's own requests that shows what the ranks print (a
    transfer, ``%clorch run``, ``--profile``): the notebook passes its display class."""

    def __call__(self, ranks: tuple[int, ...], *, merge: bool = True,
                 hosts: Mapping[int, str] | None = None) -> OutputSink: ...


def plain_output(ranks: tuple[int, ...], *, merge: bool = True, hosts: Mapping[int, str] | None = None) -> OutputSink:
    """The :class:`ShowOutput` of plain Python: the ranks' output is not shown (their logs keep it)."""
    return PlainSink()


class WidgetHook(Protocol):
    """Where the ranks' comm messages (widgets: ipywidgets, ``tqdm.auto`` bars) go, between cells
    and, ordered by the output hook's ``comm``, during them."""

    def from_rank(self, rank: int, msg: dict[str, Any]) -> None:
        """A rank's ``comm_open``, ``comm_msg`` or ``comm_close``, as it arrived."""

    def close(self) -> None:
        """The session is stopping: forget the ranks' comms (nothing is delivered after this)."""


class Debugger(Protocol):
    """JupyterLab's debugger panel pointed at one rank (``%clorch debugger``)."""

    def event(self, rank: int, msg: dict[str, Any]) -> None:
        """A rank's ``debug_event``."""

    def uninstall(self) -> None:
        """The driving process answers debug requests itself again."""


class SessionHooks:
    """What the process that drives a session offers between cells. The base class offers nothing
    (plain Python: a script, an agent, the release check): the ranks' widget messages are
    dropped, a cell's wait changes nothing around it, and the debugger panel is refused. Each is
    called on the session's own thread; see the module docstring for one that raises."""

    #: how the session's refusals name the user's next step (a script's methods by default)
    verbs: Verbs = SCRIPT_VERBS
    #: Who numbers a user's cells (the ``Cell In[n]`` of the ranks' tracebacks). Each rank counts
    #: its own cells unless told a number, so after a cell on some ranks only, a later cell on
    #: all of them was ``In[4]`` on one rank and ``In[5]`` on another, and their identical
    #: tracebacks no longer merged. The rule: a cell given a ``cell_number`` runs under it;
    #: one given none, while this is False (plain Python), is numbered by the session (one
    #: counter per session, past every number it sent, the same for every rank the cell runs
    #: on); while True, the driver numbers its users' cells itself and a cell without a number
    #: is one of its own requests (the notebook: each ``%%distributed`` cell is sent the
    #: notebook's ``[n]``, and ``%clorch debug``'s ``%debug`` goes unnumbered, as it always did).
    numbers_cells: bool = False

    def widgets(self, relay: Any) -> WidgetHook | None:
        """Where the ranks' comm messages go for this group of ranks (``relay``: its
        :class:`~clorch_repl.session.relay.Relay`); None drops them."""
        return None

    def waiting(self) -> ContextManager[None]:
        """Held while a cell is waited for (the notebook kernel reports itself busy). Raising on
        entry or exit leaves ``run`` as a raising output hook does."""
        return contextlib.nullcontext()

    def notice(self, text: str) -> None:
        """A line of the session's own before a cell's output: the ranks it runs on have no group
        (:func:`~.recovery.degraded_notice`). A ``RuntimeWarning`` by default (Python shows each
        text once, at the user's line that ran the cell); the notebook prints it."""
        warnings.warn(text, RuntimeWarning, stacklevel=users_stacklevel())

    def cell_ended(self, cell_number: int | None) -> None:
        """A user's cell (``cell_number``: the number its front end gave it, if any) has ended,
        however it ended. Raising after a cell that ended well leaves ``run`` with the exception
        (the outcome is lost); after a cell that raised, it is logged and the cell's own
        exception leaves ``run``."""

    def debugger(self, rank_handle: Any, rank: int) -> Debugger:
        """The debugger panel forwarded to ``rank``, installed."""
        raise ClorchError(f"the debugger panel is JupyterLab's: {self.verbs.debugger} works in a notebook kernel only")
