"""The rank zygote: one process per local session that has imported what a rank's kernel imports
(torch, ipykernel, the rank's kernel classes) once, and forks each rank from that state.

    python -m clorch_repl.host.zygote FD ROOM

Why (issue 39): a cold rank spent about 1.26 s of CPU before its group formed (8 ranks on the
2-core box), 1.0 s of it importing torch in its join and 0.2 s importing ipykernel: N ranks cost N
times that, so a start grew with the rank count wherever the ranks outnumber the cores. A forked
rank shares those pages with the zygote and pays for its kernel's start only.

What a rank is does not change. For each request the zygote forks the rank's **supervisor**
(:mod:`.supervisor`, run in-process: its own session, the rank's log as stdout and stderr, the
rank's environment and working directory), and the supervisor forks the **kernel**, which runs
:func:`clorch_repl.kernel.app.main` in-process instead of exec'ing ``python -m
clorch_repl.kernel.app``: the kernel is still the supervisor's child, the supervisor still its
subreaper and the mirror of its exit status. The supervisor's parent is the zygote; it watches
the notebook itself, through a pidfd the zygote opened (:class:`Notebook`), and ends its rank
when the notebook is gone as before. The zygote exits when the notebook's end of its socket
closes (the notebook's exit, even by SIGKILL, or the launcher's close) or the notebook is gone;
a zygote killed alone leaves the ranks running (the launcher forks the next ones from a new one).

The protocol (a ``SOCK_SEQPACKET`` socket pair; the notebook's side is
:mod:`clorch_repl.launchers.forked`): a request is one JSON message ``{"argv", "env", "cwd"}``
(``argv``: the supervisor's command line as :func:`.supervisor.command` builds it) carrying the
log's descriptor; the answer ``{"pid": N}`` (the supervisor's pid) or ``{"error": "..."}``; and,
whenever a supervisor has exited, ``{"exited": N, "returncode": R}`` (Popen's convention). The
launcher's orderly close is ``{"close": true}`` before its end closes (see :func:`serve`).

What a forked kernel shares with its zygote that a fresh interpreter would not: the hash seed of
``str`` (so set orders agree across ranks) and whatever module state was made at import (NumPy's
global generator is re-seeded in each kernel, as ``random`` re-seeds itself after a fork).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any, Callable, Iterator

from . import proctitle
from ..kernel import KERNEL_MODULE  # the kernel a forked supervisor runs in-process (anything else: exec'd)

logger = logging.getLogger(__name__)

#: how often the zygote looks for its parent, the notebook (the supervisors look every 0.1 s)
PARENT_POLL_MS = 200
#: the largest request (a rank's whole environment) the socket takes in one message
MAX_MESSAGE = 1 << 20
#: the launcher's last message: an orderly close (see serve)
CLOSE_MESSAGE = b'{"close": true}'


def preload() -> None:
    """What every rank imports before its group forms: a warm spare's imports and the kernel's
    classes; then the objects are frozen out of the collector, so that a supervisor forked from
    here (which runs no user code) does not copy the pages its collections would touch."""
    from ..kernel import app

    app.warm_imports()
    app._app_class()
    from ..kernel import output, rank_kernel  # noqa: F401  (what ipykernel loads by name)
    from . import supervisor  # noqa: F401

    gc.freeze()


def run_kernel(cmd: list[str]) -> int:
    """The kernel's part, in the supervisor's forked child: what ``python -m clorch_repl.kernel.app
    ARGS`` would run, in this already-importing process."""
    from ..kernel import app

    gc.unfreeze()  # the kernel collects as any kernel does (IPython's collect at exit included)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its global generator was seeded once, in the zygote
        numpy.random.seed()
    _threads_from_environment()
    proctitle.set_cmdline(cmd)
    sys.argv = [app.__file__, *cmd[3:]]
    sys.modules["__main__"] = app  # multiprocessing's spawn re-imports the rank's main module by name
    try:
        app.main(cmd[3:])  # a shutdown request ends in os._exit (kernel.quick_exit)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - as an interpreter would: the traceback in the rank's log
        traceback.print_exc()
        sys.stderr.flush()
        return 1
    return 0


def _threads_from_environment() -> None:
    """torch's intra-op thread count as a fresh interpreter would take it from the rank's own
    environment: OpenMP read ``OMP_NUM_THREADS`` once, when the zygote imported torch, from the
    notebook's environment (measured: a forked rank ran 2 threads on this 2-core box where its
    environment, like torchrun's workers', says 1; on a many-core host each rank would have run
    one thread per core)."""
    torch = sys.modules.get("torch")
    wanted = os.environ.get("OMP_NUM_THREADS", "")
    if torch is None or not wanted.strip().isdigit() or int(wanted) < 1:
        return
    if torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))


class Notebook:
    """The zygote's parent, the notebook, as a forked supervisor watches it: through a pidfd opened
    while it surely lived (no reused pid is ever taken for it), inherited across the fork; where
    there is none (Linux before 5.3), through the zygote, which does not outlive the notebook. So a
    zygote that dies alone (the out-of-memory killer) leaves the ranks running, and the session's
    directory where it is."""

    def __init__(self) -> None:
        self.zygote = os.getpid()
        try:
            self.fd: int | None = os.pidfd_open(os.getppid())
        except (AttributeError, OSError):
            self.fd = None

    def alive(self) -> bool:
        if self.fd is None:
            return os.getppid() == self.zygote
        return not select.select([self.fd], [], [], 0)[0]  # readable once it has exited


def _child(request: dict[str, Any], log_fd: int, closing: list[int], notebook: Notebook) -> int:
    """The supervisor's process, right after the fork: the rank's session, descriptors,
    environment and working directory, then the supervisor with an in-process kernel."""
    from . import supervisor

    os.setsid()  # as jupyter_client's Popen(start_new_session=True): the rank's own process group
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in closing:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = list(request["argv"])
    opts, cmd = argv[4:argv.index("--")], argv[argv.index("--") + 1:]  # python -I -S supervisor.py OPTS -- CMD
    proctitle.set_cmdline(argv)
    in_process = _kernel_without(notebook.fd) if cmd[1:3] == ["-m", KERNEL_MODULE] else None
    return supervisor.main([*opts, "--", *cmd], in_process=in_process, parent_alive=notebook.alive)


def _kernel_without(fd: int | None) -> Callable[[list[str]], int]:
    """:func:`run_kernel`, with the supervisor's descriptor of the notebook closed first (the rank's
    process holds nothing of its supervisor's)."""
    def run(cmd: list[str]) -> int:
        if fd is not None:
            os.close(fd)
        return run_kernel(cmd)
    return run


def _fork(request: dict[str, Any], log_fd: int, closing: list[int], notebook: Notebook) -> int:
    sys.stdout.flush()  # nothing of the zygote's own buffers may reach a rank's log
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(request, log_fd, closing, notebook)
        except BaseException:  # noqa: BLE001 - the rank's log says why it never started
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(log_fd)
    return pid


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.waitstatus_to_exitcode(status)


def serve(sock: socket.socket, notebook: Notebook) -> None:
    """Fork a rank for each request until the notebook's end closes or the notebook is gone;
    report each exit. After the launcher's orderly close (a ``{"close": true}`` message), end the
    supervisors still running (:func:`_end_orphans`)."""
    children: set[int] = set()
    if _serve(sock, notebook, children):
        _end_orphans(children)


def _end_orphans(children: set[int]) -> None:
    """SIGTERM to each supervisor this zygote forked that is still running at the launcher's
    orderly close. The launcher closes it only once it has ended every rank it knows of (a retired
    zygote once none of its ranks is left), so any still here is one the notebook never learnt of:
    a start interrupted between the fork request and its answer (Ctrl-C in ``Zygote.fork``, or a
    start that jupyter_client's runner thread went on with after the notebook's thread was
    interrupted). Left alone it would live as long as the notebook, which it watches. Never on a
    socket that merely closed: the notebook died (its supervisors clean up after it, their
    session folder included, on their own) or a detached session's launcher was dropped (its
    ranks must outlive the notebook). The supervisor's SIGTERM ends its kernel, as a stop's does."""
    for pid, _ in _exited():  # those that have exited already are not orphans: collect them first
        children.discard(pid)
    for pid in sorted(children):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        logger.warning("clorch_repl zygote: supervisor %d was still running at the zygote's end; "
                       "sent SIGTERM", pid)


def _serve(sock: socket.socket, notebook: Notebook, children: set[int]) -> bool:
    """The loop of :func:`serve`; True when it ended at the launcher's orderly close."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    poller.register(wake_r, select.POLLIN)
    closing = [sock.fileno(), wake_r, wake_w]
    parent = os.getppid()
    while os.getppid() == parent:  # the socket's end may outlive the notebook in a child it forked
        for fd, _ in poller.poll(PARENT_POLL_MS):
            if fd == wake_r:
                os.read(wake_r, 4096)
                continue
            msg, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
            if not msg:
                return False  # the notebook's end closed, with no word: it died, or dropped its launcher
            if msg == CLOSE_MESSAGE and not fds:
                return True
            try:
                answer: dict[str, Any] = {"pid": _fork(json.loads(msg), fds[0], closing, notebook)}
                children.add(answer["pid"])
            except (OSError, ValueError, KeyError, IndexError) as exc:  # before the fork: nothing started
                for fd_ in fds:
                    os.close(fd_)
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            sock.send(json.dumps(answer).encode())
        for pid, status in _exited():
            children.discard(pid)
            sock.send(json.dumps({"exited": pid, "returncode": _returncode(status)}).encode())
    return False  # the notebook is gone


def _exited() -> Iterator[tuple[int, int]]:
    """(pid, wait status) of each child that has exited, collected without waiting."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, status


def main(argv: list[str]) -> int:
    notebook = Notebook()
    proctitle.set_cmdline([sys.executable, "-m", __spec__.name if __spec__ else __name__, argv[0]])
    sock = socket.socket(fileno=int(argv[0]))
    preload()
    try:
        sock.send(json.dumps({"ready": os.getpid()}).encode())  # (an interrupted start closed it meanwhile)
        serve(sock, notebook)
    except (BrokenPipeError, ConnectionResetError):  # the notebook is gone: so are we
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
