"""A rank's supervisor: a tiny process between the notebook and one rank's kernel.

    python -I -S .../supervisor.py --grace S --parent PID [--pid-file PATH] [--session-dir DIR] [--log-cap BYTES] -- CMD...

(built by :func:`command`; :func:`read_pid` reads the kernel's pid from ``--pid-file``)

Why it exists: the rank's kernel runs user code, which may hold the GIL for minutes
(``sum(range(10**11))``), so no Python thread inside the kernel can be trusted to notice that
the notebook died; and user code may start daemons that leave the kernel's process group and
session (``setsid sh -c '...' &``), which no signal to that group reaches. The supervisor runs no
user code, so it is always free to act, and it is a child subreaper (``PR_SET_CHILD_SUBREAPER``):
every process the kernel starts that is orphaned, daemons included, is re-parented to it instead
of to init. Everything a rank started is therefore always a descendant of its supervisor, and
the supervisor ends all of it:

* when the notebook (its parent, ``--parent``) is gone, even after SIGKILL: it SIGKILLs the
  kernel and every descendant at once (nobody is left to wait for a graceful end), removes the
  session's private directory (``--session-dir``) and exits; it polls ``getppid`` every 0.1 s
  and compares it with ``--parent``, the pid the launcher passed, not with its own first
  ``getppid``: a notebook that died while the supervisor was starting would otherwise never be
  noticed (the supervisor would already be an orphan at its first look). A detached session
  (``%clorch detach``) is the one exception: a hold file in the session directory (:mod:`.hold`)
  names the kernel that drives it now, and the supervisor keeps the rank while that kernel lives
  (its own parent no longer counts) and ``keep_for`` after it is gone; then it ends the rank (SIGTERM and ``--grace`` this time) and
  removes the directory and the session's file as above;
* on SIGTERM (``%clorch stop``): SIGTERM to the kernel and every descendant, ``--grace`` seconds
  for them to go, then SIGKILL to what is left;
* when the kernel exits cleanly (status 0: what a shutdown request gives, which is how
  ``%clorch stop`` ends a rank first): what it left behind gets SIGTERM and the same ``--grace``
  as a stop, then SIGKILL. The kernel then always exits before the SIGTERM of the stop arrives,
  so this is the path a stop takes; the launcher's stop waits for all ranks at once, so a stop
  still costs one grace period, not one per rank;
* when the kernel dies (a crash, a signal, a non-zero ``os._exit``): what it left behind gets
  SIGTERM and only :data:`LEFTOVER_GRACE_S`, then SIGKILL: the notebook is told of the death when
  the supervisor exits, and that report should not wait on children of a rank already gone.

While the kernel runs it also keeps the kernel's log bounded on disk (``--log-cap``, see
:mod:`.logcap`): it looks at the file the kernel's stdout and stderr point to every 0.1 s (every
20 ms while it grows) and rotates it past half the cap.

It then exits with the kernel's own status (re-raising the kernel's fatal signal on itself), so
that the notebook, which only sees this process through jupyter_client, reports "killed by signal
SIGKILL" or "exit code 3" exactly as if it had watched the kernel itself. A notebook kernel that
is not the supervisor's parent cannot wait for it (one that adopted a detached session's ranks:
:mod:`clorch_repl.launchers.adopted`), so it reads the same from a file: when the kernel ends by
itself, its status is written beside the pid file (:func:`exit_path`, :func:`read_exit`) before
anything else is done.

Signals it passes on: SIGINT (Kernel > Interrupt) reaches the kernel directly, because
jupyter_client signals the whole process group and the kernel stays in the supervisor's group; the
supervisor itself blocks SIGINT. SIGUSR1 (the stack dump of a stuck rank) and SIGUSR2 sent to the
supervisor's pid are forwarded to the kernel, so the rank's pid as jupyter_client knows it keeps
working for them.

It is started with ``python -I -S`` and imports only the standard library, so it costs a few
milliseconds at start and about nothing afterwards. It is built to grow into the per-host nanny
of multi-host sessions (it already owns the rank's whole process tree and its exit status); it
does not talk to anything over a network today.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Callable

try:
    from . import hold, logcap
except ImportError:  # run as a script (python -I -S .../supervisor.py): logcap and hold lie beside it,
    _here = os.path.dirname(os.path.abspath(__file__))  # and the variables' table (env_vars) in ../common
    sys.path[:0] = [_here, os.path.join(os.path.dirname(_here), "common")]
    import hold  # type: ignore[no-redef]
    import logcap  # type: ignore[no-redef]



def _remove_keeping_logs(session_dir: str) -> str:
    """:func:`.logfiles.remove_keeping_logs`, imported only when a notebook died (it imports logging)."""
    if __package__:
        from .logfiles import remove_keeping_logs
    else:  # run as a script: logfiles lies beside it, on sys.path since logcap's import above
        from logfiles import remove_keeping_logs  # type: ignore[no-redef]
    return remove_keeping_logs(session_dir)


PR_SET_CHILD_SUBREAPER = 36
#: How often the parent (the notebook) is checked while nothing else happens.
POLL_S = 0.1
#: When the kernel died (not a clean exit): how long what it left behind gets after SIGTERM.
LEFTOVER_GRACE_S = 1.0
#: How long a stopped rank and everything it started get after SIGTERM before SIGKILL: the one
#: grace of every kind of rank (local, multi-host, batch) unless the caller gives another.
STOP_GRACE_S = 5.0
_HANDLED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _subreaper() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children_map() -> dict[int, list[int]]:
    """ppid -> pids of every process on the host (from /proc; no psutil in here)."""
    tree: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; split after its end.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] != b"Z":
            tree.setdefault(int(fields[1]), []).append(int(name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every live (non-zombie) process below ``pid``."""
    tree = _children_map()
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in tree.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def command(python: str, grace_s: float, parent: int, cmd: list[str], *, pid_file: str | None = None,
            session_dir: str | None = None, log_cap: int | None = None) -> list[str]:
    """The command line that starts ``cmd`` below a supervisor (``python -I -S``: the standard
    library only, a few ms to start). ``parent`` is the pid of the process that must stay alive
    (the notebook, or the process that launched a job). ``log_cap``: the cap of the kernel's log
    on disk in bytes (0: none); by default :data:`logcap.CAP_ENV` of this process's environment,
    read now, so that ``%env CLORCH_LOG_CAP=...`` before ``%clorch start`` applies."""
    if log_cap is None:
        try:
            log_cap = logcap.cap_from_env(os.environ)
        except ValueError as exc:  # the user's setting: one line, not a traceback from in here
            from ..errors import ConfigError

            raise ConfigError(str(exc)) from None
    argv = [python, "-I", "-S", os.path.abspath(__file__), "--grace", str(grace_s), "--parent", str(parent),
            "--log-cap", str(log_cap)]
    if pid_file:
        argv += ["--pid-file", pid_file]
    if session_dir:
        argv += ["--session-dir", session_dir]
    return [*argv, "--", *cmd]


def read_pid(pid_file: str) -> int | None:
    """The kernel's pid the supervisor wrote into ``pid_file``; None until it is written."""
    try:
        with open(pid_file) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def exit_path(pid_file: str) -> str:
    """Where the supervisor writes how the kernel ended: beside its pid file (``x.json.pid`` ->
    ``x.json.exit``), in the same private directory."""
    return os.path.splitext(pid_file)[0] + ".exit"


def read_exit(pid_file: str) -> int | None:
    """How the kernel of the supervisor with ``pid_file`` ended, in Popen's convention (3: exit
    code 3; -9: killed by SIGKILL); None while it runs, or when its supervisor wrote nothing (it was
    killed itself, or the kernel was ended by a stop)."""
    try:
        with open(exit_path(pid_file)) as fh:
            return int(fh.read().strip())
    except (OSError, ValueError):
        return None


def _returncode(status: int) -> int:
    """A raw wait status in Popen's convention (negative: killed by that signal)."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError as exc:  # a descendant that changed user (setuid): not ours to end
            sys.stderr.write(f"clorch supervisor: cannot send signal {signum} to pid {pid}: {exc}\n")


class Supervisor:
    def __init__(self, cmd: list[str], grace_s: float, pid_file: str | None, session_dir: str | None,
                 parent: int | None = None, log_cap: int = 0,
                 in_process: Callable[[list[str]], int] | None = None,
                 parent_alive: Callable[[], bool] | None = None) -> None:
        self.cmd = cmd
        #: runs ``cmd`` in the forked child instead of exec'ing it (a rank forked from the zygote,
        #: :mod:`.zygote`, whose imports are done already); None: exec, as a fresh interpreter
        self.in_process = in_process
        #: whether the notebook lives; by default, whether we are still ``parent``'s child (a rank
        #: forked from the zygote, whose parent is the zygote, watches the notebook itself)
        self.parent_alive = parent_alive or (lambda: os.getppid() == self.parent)
        self.log_cap = log_cap
        self.grace_s = grace_s
        self.pid_file = pid_file
        self.session_dir = session_dir
        self.parent = os.getppid() if parent is None else parent
        self.kernel_pid = 0
        self.log = logcap.Watcher(0, 0)
        self.kernel_status: int | None = None  # raw wait status
        #: a detached session's hold (see .hold): keeps the rank after the notebook is gone
        self.hold = hold.Watcher(session_dir)

    def start(self) -> None:
        pid = os.fork()
        if pid == 0:  # the kernel: default signal mask and handlers, same process group
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, set())
                if self.in_process is not None:
                    os._exit(self.in_process(self.cmd))
                os.execvp(self.cmd[0], self.cmd)
            except OSError as exc:  # stderr is the rank's log: say why the rank never started
                try:
                    os.write(2, f"clorch supervisor: cannot start {self.cmd[0]!r}: {exc}\n".encode())
                except OSError:
                    pass
            finally:
                os._exit(127)
        self.kernel_pid = pid
        self.log = logcap.Watcher(pid, self.log_cap)
        if self.pid_file:
            try:  # an earlier kernel's end, under the same pid file, is not this one's
                os.unlink(exit_path(self.pid_file))
            except FileNotFoundError:
                pass
            hold.write_private(self.pid_file, str(pid))

    def _record_exit(self) -> None:
        """The kernel ended by itself: write how (:func:`exit_path`) for a notebook that cannot
        wait for this process (see the module docstring); never in the way of ending the rest."""
        if not self.pid_file or self.kernel_status is None:
            return
        try:
            hold.write_private(exit_path(self.pid_file), str(_returncode(self.kernel_status)))
        except OSError as exc:  # the session's directory is gone: nobody is left to read it
            sys.stderr.write(f"clorch supervisor: cannot record the kernel's exit status: {exc}\n")

    def _reap(self) -> None:
        """Collect every exited child (the kernel, and orphans re-parented to us)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.kernel_pid:
                self.kernel_status = status

    def run(self) -> int:
        """Wait for the kernel to end, a stop, or the notebook's death; end everything; exit code."""
        reason = "kernel"
        wait_s = POLL_S
        while self.kernel_status is None:
            info = signal.sigtimedwait(_HANDLED, wait_s)
            if info is not None:
                if info.si_signo in (signal.SIGUSR1, signal.SIGUSR2):
                    _signal_all([self.kernel_pid], info.si_signo)
                elif info.si_signo in (signal.SIGTERM, signal.SIGHUP):
                    reason = "stop"
                    break
            self._reap()
            if not self.hold.keep(self.parent_alive()):
                reason = "orphaned"
                break
            wait_s = min(POLL_S, self.log.check())
        if reason == "orphaned":
            held = self.hold.hold is not None or self.hold.was_held  # a detached session's end: graceful
            self._end_all(self.grace_s if held else 0.0)
            if held:
                self.hold.remove_session_file()
            if self.session_dir:
                kept = _remove_keeping_logs(self.session_dir)  # the notebook died: its logs are what one reads next
                if kept:
                    sys.stderr.write(f"clorch supervisor: the notebook is gone; the rank logs are kept in {kept}\n")
        else:
            if reason == "kernel":
                self._record_exit()
            clean = (reason == "kernel" and self.kernel_status is not None
                     and os.WIFEXITED(self.kernel_status) and os.WEXITSTATUS(self.kernel_status) == 0)
            self._end_all(self.grace_s if reason == "stop" or clean else LEFTOVER_GRACE_S)
        return self._exit()

    def _end_all(self, grace_s: float) -> None:
        """SIGTERM (or, with no grace, SIGKILL) the kernel and every descendant, wait up to
        ``grace_s`` for them to go, SIGKILL what is left; repeat until nothing is left, since a
        process may fork while it is being ended."""
        me = os.getpid()
        first = signal.SIGTERM if grace_s > 0 else signal.SIGKILL
        left = descendants(me)
        if not left:  # the usual end of a stop or restart: one look at /proc, not three
            self._reap()
            return
        _signal_all(left, first)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._reap()
            if not descendants(me):
                break
            signal.sigtimedwait([signal.SIGCHLD], 0.05)
        for _ in range(100):
            left = descendants(me)
            self._reap()
            if not left:
                break
            _signal_all(left, signal.SIGKILL)
            signal.sigtimedwait([signal.SIGCHLD], 0.02)
        self._reap()

    def _exit(self) -> int:
        status = self.kernel_status
        if status is None:
            return 1
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            try:  # the kernel's crash may have dumped core; the supervisor's copy of it must not
                import resource

                resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
            except (ImportError, ValueError, OSError):
                pass
            if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those cannot be caught or blocked
                signal.signal(sig, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
            os.kill(os.getpid(), sig)
            time.sleep(1)  # the signal ends us; only an uncatchable-by-default one returns here
            return 128 + sig
        return _returncode(status)


def main(argv: list[str], in_process: Callable[[list[str]], int] | None = None,
         parent_alive: Callable[[], bool] | None = None) -> int:
    grace_s, pid_file, session_dir, parent, log_cap = 5.0, None, None, None, 0
    try:
        split = argv.index("--")
    except ValueError:
        sys.stderr.write("clorch supervisor: usage: supervisor.py [--grace S] [--parent PID] [--pid-file P] "
                         "[--session-dir D] [--log-cap BYTES] -- CMD...\n")
        return 2
    opts, cmd = argv[:split], argv[split + 1:]
    for key, value in zip(opts[::2], opts[1::2]):
        if key == "--grace":
            grace_s = float(value)
        elif key == "--pid-file":
            pid_file = value
        elif key == "--session-dir":
            session_dir = value
        elif key == "--parent":
            parent = int(value)
        elif key == "--log-cap":
            log_cap = int(value)
    if not cmd:
        sys.stderr.write("clorch supervisor: no command to run\n")
        return 2
    signal.pthread_sigmask(signal.SIG_BLOCK, _HANDLED)
    if not _subreaper():
        sys.stderr.write("clorch supervisor: PR_SET_CHILD_SUBREAPER unavailable; daemons a rank "
                         "starts may outlive it\n")
    sup = Supervisor(cmd, grace_s, pid_file, session_dir, parent, log_cap, in_process, parent_alive)
    sup.start()
    return sup.run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
