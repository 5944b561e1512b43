"""Process plumbing shared by worker kernels and batch jobs: free ports, process trees and their
SIGKILL, waiting for processes to be gone, reading the end of a process's log, and the watchdog
that ends a rank when the process that started it is gone. Ending a group of ranks through their
supervisors is :mod:`clorch_repl.placement.teardown`, built on these.

Processes are only ever signalled by the pid or process group we started, never by name.
"""

from __future__ import annotations

import logging
import os
import random
import select
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterable

import psutil

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"


#: Where the kernel's ephemeral ports are set (the source ports of outgoing connections, and what
#: a bind to port 0 gets)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: The lowest port :func:`free_port` chooses (below it: well-known services, Jupyter's 8888, ...)
LOWEST_CHOSEN_PORT = 10000
#: How many random ports below the ephemeral range are tried before port 0 is asked for
PORT_TRIES = 64


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int] | None:
    """The kernel's ephemeral port range (low, high), or None where it cannot be read (not Linux)."""
    try:
        with open(path) as fh:
            low, high = (int(v) for v in fh.read().split()[:2])
    except (OSError, ValueError):
        return None
    return low, high


def free_port(host: str = LOOPBACK, ephemeral: tuple[int, int] | None | str = "read") -> int:
    """A TCP port that was free on ``host`` a moment ago (for MASTER_PORT), chosen below the
    kernel's ephemeral range when there is room (``ephemeral``: that range, read from
    :data:`EPHEMERAL_RANGE_FILE` by default).

    Why not simply port 0's: the port is bound again only later, by another process (rank 0's
    rendezvous store, seconds after the choice), and port 0 hands out a port of the ephemeral
    range, the very range from which every outgoing connection on the host meanwhile takes its
    source port (every rank's gloo pairs, every store client, every kernel's ZeroMQ connects).
    One of them taking it makes rank 0's bind fail with "Address already in use", a failed start
    seen about once in a thousand starts on a busy host. Below the range only an explicit bind
    can take it. Where there is no room (the range starts below :data:`LOWEST_CHOSEN_PORT`) or
    :data:`PORT_TRIES` random candidates were all taken, port 0's."""
    span = ephemeral_range() if ephemeral == "read" else ephemeral
    if isinstance(span, tuple) and span[0] - LOWEST_CHOSEN_PORT >= PORT_TRIES:
        for port in random.sample(range(LOWEST_CHOSEN_PORT, span[0]), PORT_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:  # in use (or not ours to take): the next candidate
                    continue
                return port
        logger.debug("no free port among %d tried below the ephemeral range %s on %s: port 0's", PORT_TRIES,
                     span, host)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


#: what :func:`describe_exit` adds to a SIGKILL, the signal the kernel's OOM killer sends
OOM_HINT = "out of memory? the OOM killer sends SIGKILL"


def describe_exit(returncode: int | None) -> str:
    """``-9`` -> ``"killed by signal SIGKILL"``; ``3`` -> ``"exit code 3"``."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = str(-returncode)
        hint = f" ({OOM_HINT})" if -returncode == signal.SIGKILL else ""
        return f"killed by signal {name}{hint}"
    return f"exit code {returncode}"


def exit_in_a_table(exit: str) -> str:
    """:func:`describe_exit`'s text without its hint, for one cell of a table (``%clorch status``,
    the live panel): the hint made every row of the status table 120 columns wide, and the
    death report and the refusal of the next cell still say it."""
    return exit.replace(f" ({OOM_HINT})", "")


#: How far back from the end of a log :func:`tail_bytes` reads at most. A log's last line can be
#: endless (a progress bar rewritten with ``\r`` and never ended, or 64 MB without a newline);
#: reading further back would make ``%clorch logs`` and the report of a dead rank wait on it.
TAIL_MAX_BYTES = 1024 * 1024


def tail_bytes(fh: Any, lines: int | None, block: int = 65536, max_bytes: int = TAIL_MAX_BYTES) -> bytes:
    """The last ``lines`` lines of a binary file (all of it with None), as a terminal would show them.

    Read from the end in blocks, counting newlines in each new block only (linear in what is
    read), and never more than ``max_bytes`` back: when that is not enough for ``lines`` lines,
    what was read is returned after one line saying so. A line rewritten with carriage returns
    (a progress bar) counts once and shows its last state, as it did on a terminal; ``\r\n``
    is an ordinary line end.
    """
    if lines is None:
        return collapse_carriage_returns(fh.read())
    if lines <= 0:
        return b""
    fh.seek(0, os.SEEK_END)
    end = pos = fh.tell()
    blocks: list[bytes] = []
    newlines = 0
    while pos > 0 and newlines <= lines and end - pos < max_bytes:
        step = min(block, pos, max_bytes - (end - pos))
        pos -= step
        fh.seek(pos)
        chunk = fh.read(step)
        newlines += chunk.count(b"\n")
        blocks.append(chunk)
    data = b"".join(reversed(blocks))
    ends = data.endswith(b"\n")
    parts = (data[:-1] if ends else data).split(b"\n")  # not splitlines: a lone \r ends no line
    kept = b"\n".join(parts[-lines:]) + (b"\n" if ends else b"")
    note = b""
    if pos > 0 and len(parts) <= lines:  # no newline before the first line kept: it may be cut
        note = (f"[clorch_repl: only the last {_size(max_bytes)} of this log were read; "
                f"its start is in the file itself]\n").encode()
    return note + collapse_carriage_returns(kept)


def _size(nbytes: int) -> str:
    """``1048576`` -> ``"1 MiB"``, ``65536`` -> ``"64 KiB"``, ``100`` -> ``"100 bytes"``."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}" if nbytes % scale else f"{nbytes // scale} {unit}"
    return f"{nbytes} bytes"


def collapse_carriage_returns(data: bytes) -> bytes:
    """Each line as its last ``\r`` rewrite left it (``\r\n`` ends a line like ``\n``)."""
    if b"\r" not in data:
        return data
    out = []
    for line in data.split(b"\n"):
        if line.endswith(b"\r"):
            line = line.rstrip(b"\r")
        if b"\r" in line:
            line = next((seg for seg in reversed(line.split(b"\r")) if seg), b"")
        out.append(line)
    return b"\n".join(out)


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant, parents first; [] when it is already gone."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def signal_group(pgid: int, signum: int) -> bool:
    """Signal a whole process group; False when it no longer exists."""
    try:
        os.killpg(pgid, signum)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def kill_tree(pgid: int | None, tree: list[psutil.Process]) -> None:
    """SIGKILL the process group ``pgid`` (a process started in a session of its own leads one;
    None: no group; never our own) and every process of ``tree`` (collected earlier, e.g. by
    :func:`process_tree`) still running. psutil refuses to signal a pid that was reused by
    another process since it was collected."""
    if pgid is not None and pgid != os.getpgrp():
        signal_group(pgid, signal.SIGKILL)
    for proc in tree:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass  # gone already: what we wanted
        except psutil.Error as exc:  # not ours to signal, or a reused pid psutil refuses: it may live on
            logger.debug("could not SIGKILL pid %d: %s", proc.pid, exc)


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Wait until none of ``pids`` runs (zombies count as gone); return those still running.

    Woken by each exit itself where Linux gives process descriptors (``pidfd_open``, 5.3+), so a
    stop or restart waits for what it waits for and no poll interval more (issue 39: the 50 ms
    polls of a stop added up to a tenth of a restart on the CPU box); elsewhere it polls."""
    deadline = time.monotonic() + timeout_s
    remaining = [p for p in pids if pid_running(p)]
    while remaining:
        if time.monotonic() > deadline:
            break
        _wait_for_an_exit(remaining, min(0.05, max(0.0, deadline - time.monotonic())))
        remaining = [p for p in remaining if pid_running(p)]
    return remaining


def _wait_for_an_exit(pids: list[int], timeout_s: float) -> None:
    """Return when one of ``pids`` exits or after ``timeout_s``, whichever is first (a plain sleep
    where process descriptors are not available). A descriptor becomes readable at the exit, zombie
    or not; a pid that is already gone has none and returns at once."""
    open_pidfd = getattr(os, "pidfd_open", None)
    if open_pidfd is None:
        time.sleep(timeout_s)
        return
    fds: list[int] = []
    try:
        for pid in pids:
            try:
                fds.append(open_pidfd(pid))
            except ProcessLookupError:
                return  # gone between the caller's look and ours
            except OSError as exc:  # no pidfd here (an old kernel, a sandbox): poll instead
                logger.debug("pidfd_open(%d) failed (%s); polling", pid, exc)
                time.sleep(timeout_s)
                return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)
    finally:
        for fd in fds:
            os.close(fd)


def tree_rss(pid: int | None) -> int | None:
    """Resident memory of a process and its children (a rank's DataLoader workers count); None
    when it cannot be read."""
    if pid is None:
        return None
    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return None


def pid_running(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped) is not running."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch_parent(parent_pid: int, on_orphaned: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """Call ``on_orphaned`` (from a daemon thread) as soon as ``parent_pid`` is no longer our parent.

    Polling getppid is the portable way to notice a parent's death even when it was SIGKILLed
    (no chance for it to clean up); prctl(PR_SET_PDEATHSIG) fires when the parent *thread* exits,
    which is wrong for a parent that launches us from a worker thread.
    """

    def run() -> None:
        while True:
            if os.getppid() != parent_pid:
                on_orphaned()
                return
            time.sleep(interval_s)

    thread = threading.Thread(target=run, name="clorch-parent-watch", daemon=True)
    thread.start()
    return thread


def end_own_group() -> None:
    """End this process and, when it leads its own process group (as every rank we start does),
    everything in that group: a rank's DataLoader workers and other children go with it."""
    try:
        kill_tree(None, process_tree(os.getpid())[1:])
        if os.getpgrp() == os.getpid():
            os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)

