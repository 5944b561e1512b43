"""A rank's files on the host where its kernel runs: its log, its stack-dump file and its pid file.

Both sides of the seam read them: the ``local`` launcher on the notebook's own host, and the nanny
(:mod:`clorch_repl.host.nanny`) on a remote host, which sends what they say back as messages. One place
therefore knows how a log is tailed, where a kernel's part of it starts after a restart, how a
crash report is cut out of it and how a stack dump is asked for and read.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import re
import signal
import time
from dataclasses import dataclass, field

from ..common import procs
from ..common.atomic import remove_quietly
from ..common.cell_boundary import dump_line_calls_the_cell
from ..kernel import KERNEL_MODULE
from . import logcap

logger = logging.getLogger(__name__)

#: A death report shows at most this much of one log line (a progress bar never ended, a dump).
REPORT_LINE_CHARS = 2000


def private_file(path: str) -> int:
    """Open ``path`` for appending, readable by this user only (0600), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


#: the kernel's entry point as a stack dump writes its file: its frame marks the main thread
_KERNEL_FILE = KERNEL_MODULE.replace(".", "/") + ".py"


def main_thread_stack(dump: str) -> str:
    """The main thread's stack from a faulthandler dump: that is where a cell runs.

    A rank's kernel dumps its main thread only (``Stack (most recent call first):``, see
    :mod:`clorch_repl.kernel.app`); a dump of every thread (``Current thread 0x...`` and
    ``Thread 0x...`` blocks, as older ranks wrote) is cut to the main thread's block, since the
    kernel's own threads (iopub, heartbeat, watchdogs) only bury it.

    Linux hands the signal to the main thread unless that thread cannot take it right then (a
    signal already pending); then another thread's stack is dumped. A main-thread-only dump whose
    stack does not reach the kernel's entry point is such a dump, and says nothing of where the
    cell is: "" (unknown), never another thread's stack passed off as the rank's place.
    """
    sections: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent call first)")):
            sections.append([line])
        elif sections and line.strip():
            sections[-1].append(line)
    for section in sections:
        if any("_run_module_as_main" in line or _KERNEL_FILE in line for line in section):
            return "\n".join(trim_kernel_frames(section))
    if len(sections) == 1 and sections[0][0].startswith("Stack (most recent call first)"):
        logger.debug("the stack dump caught another thread than the main one: %s", sections[0][1:2])
        return ""
    return dump


def trim_kernel_frames(lines: list[str]) -> list[str]:
    """Cut a faulthandler stack (most recent call first) where the cell's code was called from
    IPython: what lies below is the same kernel machinery in every dump."""
    for i, line in enumerate(lines):
        if dump_line_calls_the_cell(line):
            return [*lines[:i], "  ... (the kernel's own frames)"]
    return lines


#: faulthandler's thread header names the thread by its address (``Current thread 0x00007f..``),
#: which differs between processes running the very same code.
_THREAD_ID = re.compile(r"^(\s*(?:Current thread|Thread)) 0x[0-9a-fA-F]+", re.MULTILINE)


def without_thread_ids(dump: str) -> str:
    """A faulthandler stack without its threads' addresses: ``Current thread (most recent call
    first):``. Why: the address is the only thing that differs between the stacks of ranks
    stuck at the same line, it means nothing to a reader, and with it a report could not show
    such ranks' identical stacks once (see :func:`report_stack`)."""
    return _THREAD_ID.sub(r"\1", dump)


#: a faulthandler frame's file: ``  File "/venv/lib/python3.11/site-packages/torch/x.py", line 3 in f``
_DUMP_FILE = re.compile(r'^(\s*File ")([^"]+)(")')
#: the rank kernel's own stream (clorch_repl/kernel/output.py, tracebacks.py) is under a user's
#: print: never where the user's code is, and a report that named it sent readers into clorch
_OWN_FRAMES = os.sep + os.path.join("clorch_repl", "kernel") + os.sep


def environment_path(path: str) -> str:
    """``site-packages/torch/x.py`` for a file of an installed package: the rest of the path is
    the environment's, the same on every rank and four lines of noise in a report."""
    marker = os.sep + "site-packages" + os.sep
    return "site-packages" + os.sep + path.split(marker, 1)[1] if marker in path else path


def _report_line(line: str) -> str | None:
    match = _DUMP_FILE.match(line)
    if match is None:
        return line
    if _OWN_FRAMES in match.group(2):
        return None
    return match.group(1) + environment_path(match.group(2)) + line[match.end(2):]


def report_stack(dump: str) -> list[str]:
    """A stack dump's lines as every report shows them: without thread addresses, cut below the
    cell (:func:`trim_kernel_frames`, a no-op on a dump already cut), installed packages' paths
    from ``site-packages/`` (:func:`environment_path`), the rank kernel's own frames left out;
    equal lists mean equal stacks, so that ranks stuck at the same place are shown under one
    heading."""
    lines = trim_kernel_frames(without_thread_ids(dump).rstrip().splitlines())
    return [shown for shown in map(_report_line, lines) if shown is not None]


#: How far before faulthandler's report a C++ exception's ``terminate called`` line is looked for.
ABORT_CAUSE_LINES = 40
#: Lines of a c10 exception's C++ stack (``Exception raised from ...``, ``frame #3: ...``).
_CPP_FRAME_LINES = ("Exception raised from", "frame #")


def _clip(line: str, rank: int) -> str:
    if len(line) <= REPORT_LINE_CHARS:
        return line
    return f"... ({len(line) - REPORT_LINE_CHARS} characters more; %clorch logs {rank}) {line[-REPORT_LINE_CHARS:]}"


@dataclass
class RankFiles:
    """The files of one rank in a private directory (0700) of its host."""

    dir: str
    rank: int
    #: where the current kernel's part of the log begins (after its start banner): a restart
    #: appends to the same log, and a death report must show only what the dead kernel wrote
    log_start: int = 0
    #: which rotation (:mod:`.logcap`) the log was at when the current kernel started: a rotation
    #: since then moved its part, banner included, into the log's older half
    log_rotation: tuple[int, int] | None = None
    #: the log's size when the notebook's latest cell began (:meth:`cell_began`): a death report
    #: shows what the rank wrote in the cell it died in, not an earlier cell's traceback
    cell_start: int = 0
    #: the log opened for reading, to learn its size (:meth:`cell_began`); None until the first
    #: cell of the current kernel, and after :meth:`close`
    _log_reader: int | None = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def log_path(self) -> str:
        """Joined once (``dir`` and ``rank`` never change): the reports and the tails ask it often."""
        return os.path.join(self.dir, f"rank{self.rank}.log")

    @functools.cached_property
    def stack_path(self) -> str:
        return os.path.join(self.dir, f"rank{self.rank}.stack")

    def open_log(self) -> int:
        """A new kernel of this rank starts: write its banner, remember where its part begins and
        return the log's descriptor for the kernel's stdout and stderr (the caller closes it)."""
        os.close(private_file(self.stack_path))
        self.close()  # (the next cell opens the log afresh: it may be another file by now)
        fd = private_file(self.log_path)
        with open(fd, "ab", closefd=False) as log:
            log.write(f"--- clorch_repl: rank {self.rank} starting at {time.ctime()} ---\n".encode())
        self.log_start = os.fstat(fd).st_size
        self.log_rotation = self._rotation()
        return fd

    def cell_began(self) -> None:
        """The notebook sends this rank a cell now: remember where the log ends.

        Asked of every rank before every cell, so through a descriptor held open for it: an
        ``lseek`` to the end, 0.25 us, where a ``stat`` of the path cost 1.9 us (0.1 ms a cell at
        64 ranks on the 2-core box, before any rank had its request: issue 39). Sound because the
        log is never replaced while the session has it: :mod:`.logcap` rotates it by copying and
        truncating it in place, and a new kernel of the rank (:meth:`open_log`) drops the
        descriptor, so the next cell opens whatever file the path then names."""
        try:
            if self._log_reader is None:
                self._log_reader = os.open(self.log_path, os.O_RDONLY | os.O_CLOEXEC)
            self.cell_start = os.lseek(self._log_reader, 0, os.SEEK_END)
        except OSError:  # no log yet, or gone: the report shows the kernel's whole part
            self.cell_start = 0

    def close(self) -> None:
        """Let go of the log's descriptor (:meth:`cell_began`), if one is open; the launcher's
        ``close`` calls it, and a new kernel of the rank (the next cell opens the log again)."""
        fd, self._log_reader = self._log_reader, None
        if fd is not None:
            os.close(fd)

    def _rotation(self) -> tuple[int, int] | None:
        """Which rotation the log is at: the older half's inode and change time (each rotation
        writes a new one), None before the first."""
        try:
            st = os.stat(logcap.older_path(self.log_path))
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_ctime_ns

    def open_spare_log(self, path: str) -> int:
        """A warm spare for this rank starts: its own log at ``path`` (the rank's log belongs to
        the rank's current kernel until the spare is made the rank), with a banner; returns the
        descriptor for the spare's stdout and stderr (the caller closes it)."""
        fd = private_file(path)
        os.write(fd, f"--- clorch_repl: spare for rank {self.rank} starting at {time.ctime()} ---\n".encode())
        return fd

    def take_spare_log(self, path: str) -> None:
        """A spare was made this rank's kernel (after :meth:`open_log` wrote its banner): what the
        spare wrote while it waited (its start-up: imports, CPU binding; at most the last
        ``procs.TAIL_MAX_BYTES``) goes into the rank's log, part of the current kernel's, and its
        own log is removed."""
        fd = private_file(self.log_path)
        try:
            with open(path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                fh.seek(max(0, size - procs.TAIL_MAX_BYTES))
                os.write(fd, fh.read())
        except OSError as exc:  # the rank's log says so; the rank itself is fine
            os.write(fd, f"(the warm spare's start-up output could not be read: {exc})\n".encode())
        finally:
            os.close(fd)
        remove_quietly(path)
        remove_quietly(logcap.older_path(path))  # a spare whose start-up passed half the log cap

    def log_tail(self, lines: int | None = 200) -> str:
        """The last ``lines`` lines of the whole log (earlier kernels of the rank included, each
        part starting with its banner); all of it with None. Read across a rotation
        (:mod:`.logcap`), and headed by a line saying how much of its oldest part was dropped."""
        return log_tail(self.log_path, lines)

    def current_log_tail(self, lines: int, this_cell: bool = False) -> str:
        """The last ``lines`` lines the current kernel wrote (nothing from before its banner);
        ``this_cell``: nothing from before the latest cell began either (where the log has not
        been rotated since the kernel started: offsets are comparable then). Reads at most
        ``procs.TAIL_MAX_BYTES`` from the end."""
        if self._rotation() != self.log_rotation:
            # rotated since the kernel started: its part begins after its banner, wherever that now is
            data = logcap.read_bytes(self.log_path, procs.TAIL_MAX_BYTES)
            banner = f"--- clorch_repl: rank {self.rank} starting at ".encode()
            at = data.rfind(banner)
            if at >= 0:
                data = data[data.find(b"\n", at) + 1:]
        else:
            with open(self.log_path, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                start = max(self.log_start, self.cell_start if this_cell else 0, size - procs.TAIL_MAX_BYTES)
                fh.seek(start)
                data = fh.read(size - start)
        return procs.tail_bytes(io.BytesIO(data), lines).decode(errors="replace")

    def death_report(self, lines: int = 15) -> str:
        """What the dead kernel's log says about its end, from the cell it died in: the faulthandler
        report of a crash (its first, most recent frames, which are the user's) when there is one,
        else the last lines.
        A C++ exception that aborted the process (``terminate called after throwing ...``, as
        gloo's size checks and NCCL's watchdog end a rank) wrote what it was just before: that
        comes first, without the C++ frames torch appends to it."""
        tail = self.current_log_tail(400, this_cell=True).splitlines()
        starts = [i for i, line in enumerate(tail) if line.startswith("Fatal Python error")]
        if not starts:
            return "\n".join(_clip(line, self.rank) for line in tail[-lines:])
        fatal = starts[-1]
        cause = next((tail[j:fatal] for j in range(fatal - 1, max(fatal - ABORT_CAUSE_LINES, 0) - 1, -1)
                      if tail[j].startswith("terminate called")), [])
        cause = [line for line in cause if line.strip() and not line.startswith(_CPP_FRAME_LINES)]
        report = [line for line in tail[fatal:] if not line.startswith("Extension modules")]
        return "\n".join(_clip(line, self.rank) for line in (cause + trim_kernel_frames(report))[:lines])

    def dump_stack(self, pid: int | None, wait_s: float = 0.5) -> str:
        """Where the kernel's main thread is right now: SIGUSR1 makes its faulthandler write the
        main thread's stack into the stack file (works while it is stuck in C); "" when it is gone.

        The dump is complete once the file has stopped growing for one poll after a line ended:
        faulthandler writes it line by line, so a read may catch it half written.
        """
        if pid is None:
            return ""
        start = os.path.getsize(self.stack_path)
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            return ""
        deadline = time.monotonic() + wait_s
        text = previous = ""
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with open(self.stack_path, "rb") as fh:
                fh.seek(start)
                text = fh.read().decode(errors="replace")
            if text and text == previous and text.endswith("\n"):
                break
            previous = text
        return main_thread_stack(text)


def log_tail(path: str, lines: int | None) -> str:
    """The last ``lines`` lines (None: all) of the log at ``path``, one log across a rotation
    (:mod:`.logcap`); when its oldest part was dropped, a line saying how much comes first
    (``%clorch logs`` of a flood past the cap says so, whatever the tail shows)."""
    data = logcap.read_bytes(path, None if lines is None else procs.TAIL_MAX_BYTES + 1)
    text = procs.tail_bytes(io.BytesIO(data), lines).decode(errors="replace")
    return logcap.note(path) + text
