"""``%clorch suspend`` and ``%clorch resume`` (issue 37), and the idle suspend of ``%clorch start
--suspend-after`` / ``%clorch suspend --after``.

The commands only parse, delegate to the session (:mod:`clorch_repl.session.suspend`) and print;
:class:`ClorchMagics` takes them as its ``_suspend`` and ``_resume``.

Why the idle suspend is a timer on the notebook kernel's event loop (as the ``%clorch top`` panel
and the comm bridge tick): its callback runs on the kernel's main thread between cells, never while
a cell's relay talks to the ranks, so no second thread ever touches the ranks' sockets. It cannot
print into a cell that is not running, so what it did is said at the start of the next cell.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Callable

from ..errors import ClorchError, ConfigError
from ..common.human import duration
from ..session.lifecycle import SessionState
from ..session.suspend import cpu_refusal, refuse_cell
from . import views
from .arguments import argument, magic_arguments, parse

logger = logging.getLogger(__name__)

__all__ = ["IdleSuspend", "end_idle_suspend", "parse_duration", "refuse_cell", "resume_command", "set_idle_suspend",
           "suspend_after_option", "suspend_command"]

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
#: The longest idle wait --suspend-after and suspend --after take (days)
MAX_IDLE_DAYS = 30

suspend_after_option = argument(
    "--suspend-after", metavar="DURATION", default=None, dest="suspend_after",
    help="suspend by itself (every GPU given back, every rank's state kept) once no cell has run for this "
         "long, e.g. 30m, 2h, 900 (seconds); 0 turns it off")


def parse_duration(value: str | None, what: str = "--suspend-after") -> float | None:
    """``90``, ``90s``, ``30m``, ``2h``, ``1d`` -> seconds; ``0`` -> 0 (off); None when not given.
    At most :data:`MAX_IDLE_DAYS`: a longer wait is no idle suspend but a typo (``99999d`` was
    taken, and never fired), as ``--keep-for``'s limit says."""
    if value is None:
        return None
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d)?\s*", str(value).lower())
    if match is None:
        raise ConfigError(f"{what} takes a duration such as 30m, 2h or 900 (seconds); got {value!r}")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if seconds > MAX_IDLE_DAYS * _UNITS["d"]:
        raise ConfigError(f"{what} must be at most {MAX_IDLE_DAYS}d ({MAX_IDLE_DAYS} days); got {value!r} (0 turns "
                          "the idle suspend off)")
    return seconds


class IdleSuspend:
    """Suspends the session of ``magics`` once no cell has run for ``after_s`` seconds.

    ``loop``: where the check is scheduled (the kernel's running asyncio loop by default; None in
    a terminal IPython, where the check runs only at the start of each cell and so never fires:
    :meth:`arm` says so). ``clock``: time.monotonic, or a test's."""

    def __init__(self, magics: Any, after_s: float, loop: asyncio.AbstractEventLoop | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.magics = magics
        self.after_s = after_s
        self.loop = loop
        self.clock = clock
        self.last = clock()
        #: what the idle suspend did, said at the next cell's start
        self.notice: str | None = None
        self._handle: Any = None
        self.fired = False

    def arm(self) -> None:
        """Listen to the notebook's cells and schedule the first check."""
        events = getattr(self.magics.shell, "events", None)
        if events is not None:
            events.register("pre_run_cell", self.pre_run_cell)
            events.register("post_run_cell", self.post_run_cell)
        self._schedule(self.after_s)

    def disarm(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        events = getattr(self.magics.shell, "events", None)
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                if events is not None:
                    events.unregister(name, callback)
            except ValueError:  # never registered (no shell events): nothing to take off
                logger.debug("the idle suspend's %s hook was not registered", name)

    def touch(self) -> None:
        """A cell ran: the idle time starts again (and, after a resume, a later suspend can fire)."""
        self.last = self.clock()
        self.fired = False

    def left_s(self) -> float:
        return self.after_s - (self.clock() - self.last)

    def _schedule(self, delay: float) -> None:
        if self.loop is not None:
            self._handle = self.loop.call_later(max(delay, 0.5), self.check)

    def pre_run_cell(self, *_: Any) -> None:
        if self.notice:
            print(self.notice, flush=True)
            self.notice = None
        self.touch()

    def post_run_cell(self, *_: Any) -> None:
        self.touch()

    def check(self) -> None:
        """On the event loop between cells: suspend when the time has come, else look again then."""
        self._handle = None
        left = self.left_s()
        session = self.magics.session
        if left > 0 or self.fired or session is None or not session.running:
            self._schedule(left if left > 0 else self.after_s)
            return
        if session.life.state is not SessionState.READY or (session.relay is not None and session.relay.busy()):
            self._schedule(min(self.after_s, 60.0))  # suspended already, recovering, or a cell still runs
            return
        self.fired = True
        idle = duration(self.clock() - self.last)
        try:
            line = session.suspend()
            self.notice = f"clorch: no cell ran for {idle}, so the session was suspended (--suspend-after): " \
                          f"{line.removeprefix('clorch: ')}"
        except ClorchError as exc:
            self.notice = f"clorch: no cell ran for {idle}, but the session could not be suspended: {exc}"
        except Exception as exc:  # noqa: BLE001 - on the kernel's loop: said at the next cell, never lost
            logger.exception("the idle suspend failed")
            self.notice = f"clorch: no cell ran for {idle}, but the idle suspend failed: {type(exc).__name__}: {exc}"
        logger.info("%s", self.notice)
        self._schedule(self.after_s)


def set_idle_suspend(magics: Any, after_s: float | None) -> str | None:
    """Arm (or with 0 end) the idle suspend of ``magics``' session; the line that says so."""
    old = getattr(magics, "_idle_suspend", None)
    if old is not None:
        old.disarm()
        magics._idle_suspend = None
    if not after_s:
        return "clorch: the session will not suspend by itself" if old is not None else None
    try:
        loop = asyncio.get_running_loop()  # the kernel's, between cells
    except RuntimeError:
        loop = None
    idle = IdleSuspend(magics, after_s, loop)
    idle.arm()
    magics._idle_suspend = idle
    if loop is None:
        return (f"clorch: no event loop runs between cells here (a terminal IPython), so --suspend-after "
                f"{duration(after_s)} cannot fire; %clorch suspend suspends now")
    return f"clorch: the session suspends by itself once no cell has run for {duration(after_s)}"


def end_idle_suspend(magics: Any) -> None:
    """The session ends (``%clorch stop``, the extension unloaded): its idle suspend ends with it,
    unsaid. Left armed, its timer woke for good on the kernel's loop (for a magics object an
    unload had dropped, too), and the next ``%clorch start`` said "the session will not suspend by
    itself" of a session that never had the setting."""
    set_idle_suspend(magics, 0)  # (its line, said only when one was armed, is for the user's own "0")


@magic_arguments(name="clorch suspend")
@argument("--after", metavar="DURATION", default=None,
          help="do not suspend now: suspend by itself once no cell has run this long (30m, 2h, 900 s; 0: never)")
def suspend_command(self: Any, line: str) -> None:
    """Give every GPU back (each rank's GPU state moved to host memory), keeping every rank's state."""
    args = parse(suspend_command, line)
    if args is None:
        return
    if args.after is not None:
        after = parse_duration(args.after, "--after")
        session = self._session()  # a session to suspend: refused before anything is armed
        if after and (cpu := cpu_refusal(session.topology, session.hooks.verbs)) is not None:  # refused now, not at its time
            raise ClorchError(f"--after cannot work: {cpu}")
        views.notice(set_idle_suspend(self, after))
        if (keep := getattr(session, "keep_suspend_after", None)) is not None:  # a detached session's setting
            keep(after)
        return
    print(self._session().suspend(views.StartProgress()))


@magic_arguments(name="clorch resume")
def resume_command(self: Any, line: str) -> None:
    """Each rank's GPU state back on its own GPU and the group formed again."""
    if parse(resume_command, line) is None:
        return
    print(self._session().resume(views.StartProgress()))
    idle = getattr(self, "_idle_suspend", None)
    if idle is not None:
        idle.touch()
