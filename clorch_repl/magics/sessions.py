"""``%clorch detach``, ``%clorch connect`` and ``%clorch sessions``: sessions that outlive the kernel.

A mixin of :class:`~clorch_repl.magics.core.ClorchMagics` (whose module is full): the commands
parse and render here; what they do is :mod:`clorch_repl.session.reattach`'s. Also the end of the
session with the extension or the kernel (:meth:`SessionCommands.shutdown`) and the two rules the
rest of the magics ask of a detached session: the kernel's exit lets go of it rather than ending
it (:meth:`SessionCommands.release_detached`), and a kernel that another one took the session
from is told so at its next command (:meth:`SessionCommands.check_driver`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from IPython.display import display

from ..errors import ClorchError
from ..common.human import span
from ..notebook.hooks import NotebookHooks
from ..session import registry
from . import views
from .arguments import argument, magic_arguments, parse
from .suspend import end_idle_suspend, set_idle_suspend

logger = logging.getLogger(__name__)


class SessionCommands:
    """The session-file commands of ``%clorch`` (see the module docstring)."""

    session: Any
    warm: Any  # the magics' warm spares (clorch_repl.magics.warm.LoadSpares)
    kept_logs: str  # where a stop kept the last session's logs ("": nowhere), for %clorch logs

    def _forget_session(self) -> None:
        """Let go of the session, stopped: the logs its stop kept (if it kept any) are what
        ``%clorch logs`` shows from now on, whichever stop it was (``%clorch stop``, a failed
        start, an interrupted restart's leftovers)."""
        session, self.session = self.session, None
        if session is not None and session.kept_logs:
            self.kept_logs = session.kept_logs

    def shutdown(self, say: Callable[[str], None] | None = None) -> str | None:
        """Stop the ranks and end warm spares (extension unload, notebook kernel exit); what was
        ended, in a sentence for the user (``%unload_ext`` and ``%reload_ext`` print it: the ranks'
        variables go with them, which must not happen unsaid), or None when no ranks ran.
        ``say``: where the wait for a save in flight is told (None: the log, as at the kernel's exit)."""
        said = None
        try:
            if self.session is not None:
                running, n = self.session.running, self.session.topology.nproc
                if self.release_detached():  # a detached session outlives us
                    said = "the detached session's ranks keep running: %clorch sessions lists it"
                else:
                    session = self.session
                    session.stop(**({"say": say} if say is not None else {}))
                    self._forget_session()
                    kept = session.kept_logs
                    if running:
                        said = (f"stopped the session's {n} rank(s); their variables are gone"
                                + (f", their logs are kept in {kept}" if kept else ""))
        finally:
            end_idle_suspend(self)
            self.warm.end()
        return said

    def release_detached(self) -> bool:
        """At the kernel's exit: let go of a detached session (its ranks live on, kept by their
        supervisors); whether there was one. A session never detached is stopped as always."""
        from ..session.reattach import ConnectedSession, release

        if not isinstance(self.session, ConnectedSession):
            return False
        release(self.session)
        self.session = None
        return True

    def driven(self, command: str, handler: Callable[[str], Any]) -> Callable[[str], Any]:
        """``handler`` of ``%clorch COMMAND``, run once :meth:`check_driver` found this kernel still
        drives its session (the dispatcher calls it inside its error handling). ``status`` is a
        question, not a command that can fail: in a kernel whose session another one took, it
        says so and succeeds, as it does with no ranks running, so a notebook's Run All goes on
        past it (the next command that needs ranks is refused as before)."""

        def run(line: str) -> Any:
            if command == "status" and (why := self.let_go_if_taken(command)):
                print(f"clorch: this kernel drives no ranks: {why}")
                return None
            self.check_driver(command)
            return handler(line)

        return run

    def check_driver(self, command: str = "") -> None:
        """Before a ``%clorch`` command (but connect and sessions, which need no session): raise
        when another kernel took this kernel's detached session, letting go of it here."""
        if why := self.let_go_if_taken(command):
            raise ClorchError(why)

    def let_go_if_taken(self, command: str = "") -> str:
        """Why this kernel no longer drives its detached session (another kernel took it over, or
        stopped it), after letting go of it here; "" while it does, when it never detached one,
        and for connect and sessions, which need no session."""
        from ..session.reattach import check_owner

        if command in ("connect", "sessions") or self.session is None:
            return ""
        why = check_owner(self.session)
        if why:
            self.session = None
        return why

    @magic_arguments(name="clorch detach")
    @argument("--keep-for", metavar="DURATION", dest="keep_for", default=None,
              help="how long the ranks are kept once no kernel drives them, e.g. 90s, 30m, 2h (default 1h; "
                   "at most 30d)")
    @argument("--name", metavar="NAME", default=None,
              help="the session's name for %%clorch connect (default: the --name of %%clorch start, else USER-N)")
    def _detach(self, line: str) -> None:
        """Let the ranks outlive this kernel: %clorch connect NAME from any kernel of yours drives them again."""
        args = parse(self._detach, line)
        if args is None:
            return
        from ..session.reattach import ConnectedSession, detach

        keep_for = (registry.DEFAULT_KEEP_FOR_S if args.keep_for is None
                    else registry.parse_duration(args.keep_for))
        if isinstance(self.session, ConnectedSession):
            raise ClorchError(f"session {self.session.name!r} is detached already: it outlives this kernel")
        if self.session is None or not self.session.running:
            raise ClorchError("no ranks are running: run %clorch start first")
        started_as = getattr(getattr(self.session.group, "options", None), "name", None)  # %clorch start --name
        name = registry.check_name(args.name) if args.name else started_as or registry.default_name()
        idle = getattr(self, "_idle_suspend", None)  # %clorch start --suspend-after: the session's, kept
        self.session = detach(self.session, name, keep_for, views.StartProgress(), idle.after_s if idle else 0.0)
        print(f"clorch: session {name!r} detached: its ranks outlive this kernel and are kept "
              f"{span(keep_for)} once no kernel drives them; %clorch connect {name} drives them from another "
              "kernel, %clorch stop ends them")

    @magic_arguments(name="clorch connect")
    @argument("name", nargs="?", default=None, help="the session (default: the only one)")
    @argument("--take", action="store_true", help="take the session over from the kernel that drives it now")
    def _connect(self, line: str) -> None:
        """Drive a detached session of yours from this kernel (%clorch sessions lists them)."""
        args = parse(self._connect, line)
        if args is None:
            return
        from ..session.reattach import check_owner, connect

        if self.session is not None and check_owner(self.session):  # taken from us: ours no longer
            self.session = None
        name = None if args.name is None else registry.check_name(args.name)
        if self.session is not None and self.session.running:
            driven = getattr(self.session, "name", None)  # a detached session's (ConnectedSession)
            if driven is not None and name in (None, driven):
                print(f"clorch: this kernel drives session {driven!r} already")
                return
            which = f"session {driven!r}" if driven else "the ranks it started"
            raise ClorchError(f"this kernel drives {which} already, and one kernel drives one session: "
                              "%clorch detach keeps them running past this kernel, %clorch stop ends them; "
                              "then %clorch connect")
        session, tail = connect(name, args.take, views.StartProgress(), NotebookHooks())
        self.session = session
        topo = session.topology
        print(f"clorch: connected to session {session.name!r}: {topo.nproc} {topo.backend} rank(s), "
              f"generation {session.generation}")
        if tail:
            print(f"what the ranks printed lately (their logs, in {session.record.dir}):\n{tail}")
        views.notice(set_idle_suspend(self, session.suspend_after_s))  # the session's --suspend-after

    @magic_arguments(name="clorch sessions")
    def _sessions(self, line: str) -> None:
        """Your detached sessions on this host: name, ranks, owner, idle time, how long they are kept."""
        if parse(self._sessions, line) is None:
            return
        from ..session.reattach import status_rows

        header, rows = status_rows()
        if not rows:
            print("clorch: no detached sessions (%clorch detach makes one)")
            return
        display(views.table_bundle(header, rows), raw=True)

