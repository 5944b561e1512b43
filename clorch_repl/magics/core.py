"""``%clorch`` and ``%%distributed``: parse what the user typed, call the session, show the result.

No process handling and no message handling lives here (see :mod:`clorch_repl.session`); a magic
only validates its input, delegates and renders. Every mistake in the input ends in one
``UsageError`` line, never in a traceback from inside the package.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import logging
from typing import Any, Callable

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.display import display

from ..errors import ClorchError, DistributedCellError
from ..notebook.display import NotebookDisplay
from ..notebook.front_end import NotebookStdin
from ..notebook.hooks import NotebookHooks
from ..session.hooks import NoStdin
from ..session.session import Session
from ..session.suspend import cpu_refusal
from ..common import workdir
from ..common.human import headline
from ..host.logfiles import without_ansi
from ..launchers.registry import launcher_class
from ..common.topology import Topology, check_unique_in_range, parse_timeout
from . import sessions, views
from .cell_options import cell_options, notebook_cell_number
from .head_start import HeadStart
from .warm import LoadSpares
from .suspend import (end_idle_suspend, parse_duration, refuse_cell, resume_command, set_idle_suspend,
                      suspend_after_option, suspend_command)
from .arguments import (argument, hang_notice_option, launcher_options, magic_arguments, max_mb_option, one_rank, parse,
                        parse_cpu_bind, parse_hang_notice, parse_launch, parse_max_mb, parse_ranks, parse_run,
                        ranks_option, refused, stdin_ranks_option, tail_option, timeout_option, topology_options,
                        user_errors)

logger = logging.getLogger(__name__)

COMMANDS = ("start", "status", "top", "logs", "interrupt", "restart", "stop", "jobs", "why", "pull", "push", "run",
            "debug", "debugger", "suspend", "resume", "detach", "connect", "sessions")


@magics_class
class ClorchMagics(sessions.SessionCommands, Magics):
    """Holds the notebook's one session of ranks."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session: Session | None = None
        #: warm spares started when the extension was loaded, for the first %clorch start
        self.warm = LoadSpares()
        #: the live %clorch top panel, if one is open (clorch_repl.notebook.panel)
        self.panel: Any = None
        #: %%distributed cells sent from ipykernel's shell handler (installed by load())
        self.head_start = HeadStart(self)
        #: where the last %clorch stop kept its ranks' logs, for %clorch logs until the next start
        self.kept_logs = ""
        atexit.register(self.shutdown)

    def prewarm(self) -> None:
        """Warm spares for the first ``%clorch start`` (``%load_ext`` calls this; see :mod:`.warm`)."""
        self.warm.warm()

    def _session(self) -> Session:
        if self.session is None or not self.session.running:
            raise views.not_running()
        return self.session

    # -------------------------------------------------------------------------- %clorch
    @line_magic
    def clorch(self, line: str) -> Any:
        """Manage the ranks: %clorch start|status|logs|interrupt|restart|stop|jobs [--help]."""
        command, _, rest = line.strip().partition(" ")
        if command in ("", "-h", "--help", "help"):
            print(self._overview())
            return None
        if command not in COMMANDS:
            raise refused(f"unknown %clorch command {command!r}; expected one of: {', '.join(COMMANDS)}")
        handler: Callable[[str], Any] = self.driven(command, getattr(self, f"_{command}"))  # see .sessions
        with user_errors():
            return handler(rest)

    def _overview(self) -> str:
        lines = ["%clorch COMMAND [options]; %clorch COMMAND --help for each command's options.", ""]
        for command in COMMANDS:
            parser = getattr(self, f"_{command}").parser  # built by magic_arguments from the docstring
            summary = (parser.description or "").strip().split("\n\n")[0]  # the first paragraph: the rest is --help's
            lines.append(f"  {command:<10} {' '.join(summary.split()).rstrip('.')}")
        lines += ["", "%%distributed [--ranks LIST] [--timeout SECONDS] [--hang-notice SECONDS] [--no-merge] "
                  "[--gather NAME] [--max-mb MB] [--stdin-ranks LIST] [--profile [DIR]] runs a cell on every rank."]
        return "\n".join(lines)

    @magic_arguments(name="clorch start")
    @topology_options
    @launcher_options
    @hang_notice_option
    @suspend_after_option
    def _start(self, line: str) -> None:
        """Start one worker kernel per rank and form the process group."""
        progress = views.StartProgress()  # "formed in" counts from here: the launcher's set-up is waited for too
        args = parse(self._start, line)
        if args is None:
            return
        if self.session is not None and self.session.running:
            topo = self.session.topology
            raise ClorchError(f"{topo.nproc} {topo.backend} rank(s) are already running: "
                              "%clorch stop or %clorch restart first")
        if self.session is not None:  # an interrupted restart's leftovers: end them, never orphan them
            self.session.stop()
            self._forget_session()
        launcher = launcher_class(args.launcher)
        options = parse_launch(args)
        cpu_bind = parse_cpu_bind(args.cpu_bind)
        hang_notice, suspend_after = parse_hang_notice(args.hang_notice), parse_duration(args.suspend_after)
        topology = launcher.topology(options, nproc=args.nproc, devices=args.devices, backend=args.backend,
                                     timeout=args.timeout)
        topology = dataclasses.replace(topology, cpu_bind=cpu_bind)
        if suspend_after and (cpu := cpu_refusal(topology, NotebookHooks.verbs)) is not None:  # refused now
            raise ClorchError(f"--suspend-after cannot work: {cpu}")
        warm = [self.warm.take(launcher.name, topology, options)]

        def make(topo: Topology) -> Any:
            """The warm launcher, once: a later start (a failed restart closed it) makes a new one."""
            taken, warm[0] = warm[0], None
            return taken or launcher(topo, options)

        session = Session(topology, make, NotebookHooks())
        if hang_notice is not None:
            session.hang_notice_s = hang_notice
        self.session, self.kept_logs = session, ""  # before its start: a Ctrl-C just as it returns must not lose its ranks
        try:
            session.start(progress)
        except BaseException:
            self._forget_session()  # a start that failed stopped what it started (and kept its logs)
            raise
        views.notice(set_idle_suspend(self, suspend_after))

    _suspend, _resume = suspend_command, resume_command  # (clorch_repl.magics.suspend)

    @magic_arguments(name="clorch status")
    def _status(self, line: str) -> None:
        """Every rank: state, pid, device, backend, memory, uptime.

        With no ranks running it says so and succeeds: a question, not a command that failed, so
        a notebook's Run All goes on past it (before a start, after a stop, after another kernel
        took over the detached session this kernel drove)."""
        if parse(self._status, line) is None:
            return
        if self.session is None or not self.session.running:
            if self.warm.launcher is not None:  # only what the load warmed: say so
                line = views.spares_line(self.warm.usage(), "the first %clorch start")
                print(f"clorch: no ranks are running; {line}")
            else:
                print("clorch: no ranks are running; %clorch start starts them" + views.detached_hint())
            return
        session = self._session()
        views.notice(views.session_line(session))
        header, body = views.status_rows(session.status())
        display(views.table_bundle(header, body), raw=True)
        spares = session.spares()
        if spares:
            print(views.spares_line(spares))
        saves = views.saves_line(session.saves_in_flight())
        if saves:
            print(saves)

    @magic_arguments(name="clorch logs")
    @argument("rank", type=one_rank, help="the rank whose log to show")
    @tail_option
    @argument("--job", metavar="ID", default=None, help="a batch job from %%clorch jobs instead of the session")
    def _logs(self, line: str) -> None:
        """What a rank wrote to stdout and stderr, native output included, before restarts too.

        %clorch restart appends to the log (each process's part starts with a "--- clorch_repl:
        rank N starting at ... ---" line), while a dead rank's report shows only its last cell's."""
        args = parse(self._logs, line)
        if args is None:
            return
        if args.tail < 0:
            raise ClorchError(f"--tail must be 0 (everything) or more; got {args.tail}")
        text = views.log_text(self.session, self.kept_logs, args.rank,
                              None if args.tail == 0 else args.tail, args.job)
        print(without_ansi(text), end="" if text.endswith("\n") else "\n")  # the log's colour codes are a terminal's

    @magic_arguments(name="clorch interrupt")
    def _interrupt(self, line: str) -> None:
        """KeyboardInterrupt on every rank (ranks stuck in a collective: the group aborted and formed again)."""
        if parse(self._interrupt, line) is None:
            return
        session = self._session()
        stuck, recovered = session.interrupt()
        views.interrupted(stuck, recovered, session.why, session.topology.nproc, session.group)

    @magic_arguments(name="clorch restart")
    @argument("--ranks", metavar="LIST", default=None,
              help="only these ranks start afresh (dead or stuck ones): the others keep their variables and "
                   "form the group again with them")
    def _restart(self, line: str) -> None:
        """Fresh ranks and a fresh process group, same settings (or only --ranks afresh)."""
        args = parse(self._restart, line)
        if args is None:
            return
        if self.session is None:
            raise ClorchError("nothing to restart: run %clorch start first")
        ranks = parse_ranks(args.ranks)
        if ranks is not None:
            refuse_cell(self.session.life, "then %clorch restart --ranks", NotebookHooks.verbs)  # (no group formed)
        sink = None if ranks is None else NotebookDisplay(tuple(range(self.session.topology.nproc)))
        self.session.restart(views.StartProgress(), ranks=ranks, sink=sink)

    @magic_arguments(name="clorch stop")
    def _stop(self, line: str) -> None:
        """End every rank; no process is left behind."""
        if parse(self._stop, line) is None:
            return
        end_idle_suspend(self)  # (the session's --suspend-after ends with it)
        if self.session is None or not self.session.running:
            if self.session is not None and self.session.group is not None:
                self.session.stop()  # what an interrupted restart left (its launcher, warm spares)
                self._forget_session()
            count = self.warm.end()
            print(f"clorch: no ranks are running; ended the {count} warm spare(s) made when the extension loaded"
                  if count else "clorch: no ranks are running")
            return
        session, n = self.session, self.session.topology.nproc
        left = session.stop(say=lambda text: print(f"clorch: {text}", flush=True))
        self._forget_session()
        kept = session.kept_logs  # the session's files are gone, its logs are not
        if left:
            raise ClorchError(f"stopped {n} rank(s), but not everything ended: {'; '.join(left)}")
        print(f"clorch: stopped {n} rank(s)" + (f"; their logs are kept in {kept}" if kept else ""))

    @magic_arguments(name="clorch top")
    @argument("--once", action="store_true", help="print one table now, CPU measured over 0.4 s (not a live panel)")
    @argument("--stop", action="store_true", help="close the live panel")
    @argument("--interval", metavar="SECONDS", type=float, default=None,
              help="seconds between updates of the live panel (default 1)")
    def _top(self, line: str) -> None:
        """A live panel of every rank: state, cell, last line, CPU, memory, GPU, collective in flight."""
        args = parse(self._top, line)
        if args is None:
            return
        from . import top

        if not args.stop:
            self._session()  # refuses with no ranks running: a panel starts on a session
        self.panel = top.command(lambda: self.session, self.panel, args)

    @magic_arguments(name="clorch jobs")
    def _jobs(self, line: str) -> None:
        """Batch jobs started with clorch_repl.distributed.launch from this kernel."""
        if parse(self._jobs, line) is None:
            return
        from ..jobs.batch import jobs

        listed = jobs()
        if not listed:
            print("clorch: no jobs were launched from this kernel")
            return
        header = ["job", "state", "ranks", "main", "elapsed", "cause"]
        body = []
        for job in listed:
            st = job.status()
            body.append([st.id, st.state, f"{st.nproc} x {st.backend}", st.main, f"{st.elapsed_s:.1f} s",
                         headline(st.message, 160) if st.message else "-"])  # a verdict runs on
        display(views.table_bundle(header, body), raw=True)

    @magic_arguments(name="clorch why")
    @argument("--rank", metavar="R", default=None,
              help="show this rank's evidence only (the verdict still weighs every rank)")
    @argument("--all-threads", action="store_true", dest="all_threads",
              help="every thread's stack, not only the main thread's")
    def _why(self, line: str) -> None:
        """Why ranks are stuck: the first collective they disagree on, each rank's collectives and stack."""
        args = parse(self._why, line)
        if args is None:
            return
        ranks = None
        if args.rank is not None:
            try:
                ranks = [int(args.rank)]
            except ValueError:
                raise ClorchError(f"--rank must be a rank number; got {args.rank!r}") from None
        print(self._session().why(ranks, all_threads=args.all_threads))

    @magic_arguments(name="clorch pull")
    @argument("name", help="the variable to fetch from each rank")
    @ranks_option
    @max_mb_option
    def _pull(self, line: str) -> None:
        """Put {rank: NAME on that rank} into the notebook as NAME (tensors on the CPU)."""
        args = parse(self._pull, line)
        if args is None:
            return
        from ..session import transfer

        name = transfer.check_name(args.name)
        ranks, limit = parse_ranks(args.ranks), parse_max_mb(args.max_mb)  # input first, then the ranks
        self.shell.user_ns[name] = transfer.pull(self._session(), name, ranks, limit, show=NotebookDisplay)

    @magic_arguments(name="clorch push")
    @argument("name", help="the notebook variable to send to each rank")
    @ranks_option
    @max_mb_option
    def _push(self, line: str) -> None:
        """Send the notebook's NAME to every rank (or --ranks), into each rank's namespace."""
        args = parse(self._push, line)
        if args is None:
            return
        from ..session import transfer

        name = transfer.check_name(args.name, where="on the ranks")
        ranks, limit = parse_ranks(args.ranks), parse_max_mb(args.max_mb)
        if name not in self.shell.user_ns:
            raise ClorchError(f"name {name!r} is not defined in the notebook")
        transfer.push(self._session(), name, self.shell.user_ns[name], ranks, limit, show=NotebookDisplay)

    @magic_arguments(name="clorch run")
    @argument("-h", "--help", action="store_true", help="show this help (after SCRIPT, --help is the script's)")
    @ranks_option
    @argument("-i", action="store_true", dest="interactive",
              help="run in each rank's own namespace (it sees rank, device, ...), as %%run -i does")
    @argument("-m", action="store_true", dest="module", help="SCRIPT is a module name, run as python -m runs it")
    @timeout_option
    @hang_notice_option
    @argument("--no-merge", action="store_true", dest="no_merge", help="show every rank's copy of identical output")
    @argument("script", nargs="?", metavar="SCRIPT", help="the script's path on the nodes (or the module, with -m)")
    @argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's own arguments (its sys.argv[1:])")
    def _run(self, line: str) -> None:
        """Run a torchrun script on every rank (--ranks), as %run runs one: options before SCRIPT, its own after.

        The script runs unchanged in each live rank, inside the session's process group, with
        __name__ == "__main__", sys.argv and torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
        ...); its globals stay in the rank's namespace. sys.exit(0) ends it cleanly."""
        from ..session import script_run

        request = parse_run(self._run.parser, line)  # type: ignore[attr-defined]
        if request is None:
            return
        session = self._session()
        outcome = script_run.run(session, request, notebook_cell_number(self.shell), show=NotebookDisplay,
                                 stdin=NotebookStdin.current())  # its input() and pdb, as a cell's
        if not outcome.ok:
            raise DistributedCellError(outcome, request.timeout_s, merge=request.merge)

    @magic_arguments(name="clorch debug")
    @argument("rank", help="the rank whose last exception to open")
    @timeout_option
    def _debug(self, line: str) -> None:
        """Post-mortem pdb in the frames of a rank's last exception (%debug on that rank)."""
        args = parse(self._debug, line)
        if args is None:
            return
        try:
            rank = int(args.rank)
        except ValueError:
            raise ClorchError(f"%clorch debug takes a rank number; got {args.rank!r}") from None
        timeout = parse_timeout(args.timeout, "--timeout")
        session = self._session()
        check_unique_in_range([rank], session.topology.nproc, "%clorch debug", "rank")
        stdin = NotebookStdin.current()
        if isinstance(stdin, NoStdin):  # pdb would only fail inside, in its own input() (a traceback of pdb's)
            raise ClorchError(f"%clorch debug needs a front end that takes input, to answer pdb's prompts: {stdin.why}")
        # %debug on the rank: IPython's own post-mortem of sys.last_traceback, its pdb prompts
        # answered in the notebook through the cell's stdin path (clorch_repl.session.stdin).
        outcome = session.run("%debug", [rank], timeout, NotebookDisplay((rank,)), stdin_ranks=[rank],
                              stdin=stdin)
        if not outcome.ok:
            raise DistributedCellError(outcome, timeout)

    @magic_arguments(name="clorch debugger")
    @argument("rank", nargs="?", default="0", help="the rank to debug (default 0), or off")
    def _debugger(self, line: str) -> None:
        """Point JupyterLab's debugger panel at one rank's %%distributed cells (off: the notebook)."""
        args = parse(self._debugger, line)
        if args is None:
            return
        if args.rank == "off":
            if self.session is not None:
                self.session.debug_rank(None)
            print("clorch: the debugger panel debugs the notebook kernel again")
            return
        try:
            rank = int(args.rank)
        except ValueError:
            raise ClorchError(f"%clorch debugger takes a rank number or off; got {args.rank!r}") from None
        self._session().debug_rank(rank)
        print(f"clorch: the debugger panel now debugs rank {rank}'s %%distributed cells; "
              "turn the panel on (or off and on again) for it to attach there")

    # -------------------------------------------------------------------------- %%distributed
    @cell_magic
    @magic_arguments(name="%distributed")
    @ranks_option
    @timeout_option
    @hang_notice_option
    @argument("--no-merge", action="store_true", dest="no_merge",
              help="show every rank's copy of identical output (merged into one [ranks 0-1] line by default)")
    @argument("--gather", metavar="NAME", default=None,
              help="put {rank: the cell's last expression on that rank} into the notebook as NAME")
    @argument("--profile", metavar="DIR", nargs="?", const="", default=None,
              help="torch.profiler on every rank for this cell: one merged trace in DIR (default: the "
                   "session's own directory), time per rank and the straggler, if one")
    @max_mb_option
    @stdin_ranks_option
    def distributed(self, line: str, cell: str) -> None:
        """Run the cell on every rank (or --ranks), streaming each rank's output labelled.

        An exception on any rank fails the cell and shows every failed rank's traceback.
        Interrupt the notebook kernel to interrupt every rank.
        """
        with user_errors():
            options = cell_options(self.distributed, line)
            if options is None:
                return
            if options.gather is not None:  # before the ranks run it: gathering imports torch here
                workdir.torch_importable(f"--gather {options.gather}")
            session = self._session()
            number = notebook_cell_number(self.shell)
            claimed = self.head_start.claim(line, cell, number)  # never a --profile cell
            display_ = NotebookDisplay(session.chosen(options.rank_list), merge=options.merge, hosts=session.hosts())

            def run_cell() -> Any:
                if claimed is not None:  # the head start sent it already (see .head_start)
                    return session.finish(claimed, display_)  # interrupted if a Ctrl-C came in its send
                return session.run(cell, options.rank_list, options.timeout_s, display_,
                                   hang_notice_s=options.hang_notice_s, stdin_ranks=options.stdin_rank_list,
                                   cell_number=number, stdin=NotebookStdin.current())

            if options.profile is None:
                outcome = run_cell()
            else:
                from ..session import profile

                outcome, report = profile.profiled(session, options.rank_list,
                                                   options.profile or profile.default_folder(number, session), run_cell,
                                                   show=NotebookDisplay)
                display(report)  # the trace as a link (ProfileReport._repr_html_)
            if outcome.ok and options.gather is not None:
                from ..session.transfer import pull
                self.shell.user_ns[options.gather] = pull(session, None, options.rank_list, options.max_bytes,
                                                          what=f"--gather {options.gather}", show=NotebookDisplay)
        if not outcome.ok:
            raise DistributedCellError(outcome, options.timeout_s, merge=options.merge)
