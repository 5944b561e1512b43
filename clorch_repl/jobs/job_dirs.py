"""A batch job's private folder: made, marked with its owner, and swept once that owner is gone.

Every job gets a private (0700) folder for its spec, rendezvous store, results and rank logs
(:func:`job_directory`). Without ``log_dir`` it is a ``clorch-job-N-XXXXXXXX`` folder in the
temporary directory, which is clorch's to remove: the job's process removes it at exit
(:func:`clorch_repl.jobs.batch._cleanup`), and a rank's supervisor when that process dies while
the rank runs. A notebook kernel SIGKILLed (Kernel > Restart of a stuck kernel, the OOM killer)
after its jobs ended has neither chance, and its folders would stay in /tmp forever, one per job.

So each folder records who owns it (:data:`OWNER_FILE`: the owner's pid *and* its start time in
clock ticks since boot, so that a pid the system has since given to another process is not taken
for the owner, and no step of the wall clock moves it; the boot and the pid namespace it was made
in, since a ``TMPDIR`` may be shared with containers whose pids mean nothing here, under the same
hostname; and its host), and the next
``launch`` of any process of the same user sweeps the folders whose owner is gone
(:func:`sweep_stale`). The decision (:func:`verdict`) keeps a folder unless every one of these
holds: it is a real directory (not a symlink) of this user, it carries clorch's record of this
host saying the folder is clorch's own (never a caller's ``log_dir``), its owner is dead, and no
process of this user still names the folder on its command line (a rank's supervisor, which
outlives its rank, names it; so does the rank). Anything that cannot be read or decided keeps the
folder: a folder left behind is a nuisance, a folder removed under a live job is a failure.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import psutil

from ..common.atomic import write_json_atomic

logger = logging.getLogger(__name__)

#: the record of who made a job folder, inside it
OWNER_FILE = "owner.json"
#: what ``tempfile.mkdtemp(prefix=f"clorch-{job_id}-")`` names a job folder (job ids are job-N)
FOLDER_NAME = re.compile(r"clorch-job-\d+-[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Owner:
    """What a job folder's :data:`OWNER_FILE` says."""

    pid: int
    #: the owner's start, in clock ticks since boot (``/proc/<pid>/stat``'s 22nd field: what the
    #: wall clock's steps do not move); None when it could not be read
    started: int | None
    host: str
    #: the folder is clorch's to remove (False: it lies in the caller's ``log_dir``)
    owns_dir: bool
    #: the boot and the pid namespace the owner ran in (:func:`this_boot`); None: not known
    boot: str | None = None


@dataclass(frozen=True)
class Seen:
    """What was seen of one entry of the temporary directory, without following links."""

    path: str
    #: a real directory (not a symlink, not a file)
    is_dir: bool
    uid: int
    #: its record; None when there is none or it cannot be read (a folder being made, or not ours)
    owner: Owner | None


def job_directory(job_id: str, log_dir: str | None) -> tuple[str, bool]:
    """A private (0700) directory for the job's spec, results and logs, and whether it is ours to
    remove (it is not when it lies in the caller's ``log_dir``). Its owner record is written at
    once, so that a kill from here on leaves a folder the next launch can judge."""
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
        directory, owns = tempfile.mkdtemp(prefix=f"clorch-{job_id}-", dir=log_dir), False
    else:
        directory, owns = tempfile.mkdtemp(prefix=f"clorch-{job_id}-"), True
    os.chmod(directory, 0o700)
    write_json_atomic(os.path.join(directory, OWNER_FILE), owner_record(owns))
    return directory, owns


def owner_record(owns_dir: bool) -> dict[str, Any]:
    """This process as the owner of a job folder (see :class:`Owner`); a start or a boot that
    cannot be read is recorded as None, and the folder is then never swept (a pid alone proves
    nothing)."""
    return {"pid": os.getpid(), "started": start_ticks(os.getpid()), "host": socket.gethostname(),
            "owns_dir": owns_dir, "boot": this_boot()}


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot; None when there is no such process (or it
    cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[19])  # the 22nd field of stat(5); the first two are before the ")"
    except (OSError, IndexError, ValueError) as exc:
        logger.debug("cannot read the start of pid %d: %s", pid, exc)
        return None


def this_boot() -> str | None:
    """This boot of the host and this process's pid namespace, as one text: a pid and a start in
    ticks mean something only where both are the same (another boot, or a container sharing the
    temporary directory under the same hostname, would read as a dead owner)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot_id = fh.read().strip()
        return f"{boot_id} {os.readlink('/proc/self/ns/pid')}"
    except OSError as exc:
        logger.debug("cannot read this boot's id or pid namespace: %s", exc)
        return None


def parse_owner(text: str) -> Owner | None:
    """The :class:`Owner` in a record's text; None for anything else (a record of a later
    version, a damaged file): a folder whose owner is not known is kept."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    pid, started, host, owns = data.get("pid"), data.get("started"), data.get("host"), data.get("owns_dir")
    boot = data.get("boot")
    if (isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0 or not isinstance(host, str)
            or not isinstance(owns, bool) or not (boot is None or isinstance(boot, str))):
        return None
    if started is not None and (isinstance(started, bool) or not isinstance(started, int) or started < 0):
        return None
    return Owner(pid=pid, started=started, host=host, owns_dir=owns, boot=boot)


def verdict(seen: Seen, *, uid: int, host: str, boot: str | None, owner_alive: Callable[[Owner], bool],
            in_use: Callable[[str], bool]) -> str | None:
    """None when the folder is to be swept, else why it is kept (see the module docstring).
    ``owner_alive`` and ``in_use`` (a process names the folder) are asked last, only of a folder
    that is otherwise stale: they look at the host's processes."""
    if not seen.is_dir:
        return "not a real directory (a symlink or a file)"
    if seen.uid != uid:
        return f"owned by uid {seen.uid}, not this user"
    owner = seen.owner
    if owner is None:
        return f"no readable {OWNER_FILE}: not a folder clorch can judge"
    if not owner.owns_dir:
        return "it lies in a caller's log_dir"
    if owner.host != host:
        return f"made on host {owner.host}, whose processes cannot be seen here"
    if owner.boot is None or owner.boot != boot:
        return "made under another boot or pid namespace (a container sharing the folder), whose pids mean nothing here"
    if owner.started is None:
        return f"its owner (pid {owner.pid}) has no recorded start time"
    if owner_alive(owner):
        return f"its owner (pid {owner.pid}) is alive"
    if in_use(seen.path):
        return "a process (a rank or its supervisor) still names it"
    return None


def owner_alive(owner: Owner) -> bool:
    """Whether the recorded owner still runs: its pid runs, is not a zombie, and started when the
    record says (else the pid was given to another process since). A process that cannot be
    looked at counts as alive."""
    try:
        with open(f"/proc/{owner.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    except OSError as exc:  # we cannot tell, so it may be alive
        logger.debug("cannot look at pid %d: %s", owner.pid, exc)
        return True
    try:
        state, started = fields[0], int(fields[19])
    except (IndexError, ValueError):
        return True
    return state != "Z" and started == owner.started


def command_lines(uid: int) -> list[list[str]]:
    """The command lines of this user's live processes (the ranks and supervisors of any job
    folder that might still be used are among them)."""
    lines = []
    for proc in psutil.process_iter():
        try:
            if proc.uids().real == uid:
                lines.append(proc.cmdline())
        except psutil.Error:  # gone meanwhile, or not ours to read
            continue
    return lines


def names_folder(lines: Iterable[list[str]], path: str) -> bool:
    """Whether a command line names ``path`` or a file in it (a supervisor's ``--session-dir
    DIR`` and ``--pid-file DIR/rank-N.pid``, a rank's ``DIR/job.json``)."""
    inside = path.rstrip(os.sep) + os.sep
    return any(arg == path or arg.startswith(inside) for line in lines for arg in line)


def look(path: str) -> Seen | None:
    """What ``path`` is, seen through a descriptor opened without following a symlink (so the
    record read is the one in the folder judged); None when it cannot be opened at all."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        logger.debug("cannot look at %s: %s", path, exc)
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return Seen(path, stat.S_ISDIR(st.st_mode), st.st_uid, None)  # not opened: not ours to read
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        logger.debug("cannot open %s: %s", path, exc)
        return None
    try:
        st = os.fstat(fd)
        try:
            rec = os.open(OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
        except OSError as exc:
            logger.debug("no owner record in %s: %s", path, exc)
            return Seen(path, stat.S_ISDIR(st.st_mode), st.st_uid, None)
        with os.fdopen(rec, "rb") as fh:
            text = fh.read(65536).decode("utf-8", "replace")
        return Seen(path, stat.S_ISDIR(st.st_mode), st.st_uid, parse_owner(text))
    except OSError as exc:
        logger.debug("cannot read the owner record of %s: %s", path, exc)
        return None
    finally:
        os.close(fd)


def sweep_stale(root: str | None = None) -> list[str]:
    """Remove the job folders in ``root`` (the temporary directory) whose owner died without
    removing them (see the module docstring); returns the folders removed. Never raises for
    what it finds on disk: a sweep must not stop the launch it runs in."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError as exc:
        logger.debug("cannot list %s to sweep stale job folders: %s", root, exc)
        return []
    uid, host, boot = os.getuid(), socket.gethostname(), this_boot()
    lines: list[list[str]] | None = None

    def in_use(path: str) -> bool:
        nonlocal lines
        if lines is None:  # one look at the host's processes per sweep, and only when needed
            lines = command_lines(uid)
        return names_folder(lines, path)

    swept = []
    for name in sorted(n for n in names if FOLDER_NAME.fullmatch(n)):
        seen = look(os.path.join(root, name))
        if seen is None:
            continue
        why = verdict(seen, uid=uid, host=host, boot=boot, owner_alive=owner_alive, in_use=in_use)
        if why is not None:
            logger.debug("keeping job folder %s: %s", seen.path, why)
            continue
        if _remove(seen.path):
            assert seen.owner is not None
            logger.debug("swept job folder %s: its owner (pid %d) is gone and nothing runs in it", seen.path,
                         seen.owner.pid)
            swept.append(seen.path)
    return swept


def _remove(path: str) -> bool:
    """``rmtree`` (which refuses a symlink and never follows one inside); every error is logged
    and the rest is still removed. The owner record goes last, so that a sweep cut short (a
    Ctrl-C during the launch) leaves a folder the next launch can still judge and sweep. True
    when the folder is gone."""

    def failed(failed_path: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):  # FileNotFoundError: another launch sweeps it at once
            logger.debug("could not remove %s while sweeping %s: %s", failed_path, path, exc)

    def rmtree(where: str) -> None:
        if sys.version_info >= (3, 12):  # onerror is deprecated there
            shutil.rmtree(where, onexc=lambda _func, at, exc: failed(at, exc))
        else:
            shutil.rmtree(where, onerror=lambda _func, at, info: failed(at, info[1]))

    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name == OWNER_FILE:
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        rmtree(entry.path)
                    else:
                        os.unlink(entry.path)
                except OSError as exc:
                    failed(entry.path, exc)
    except OSError as exc:
        failed(path, exc)
    rmtree(path)  # the record, then the folder
    return not os.path.lexists(path)
