"""A rank's log, bounded on disk: the newest ``cap`` bytes are kept, the oldest dropped with a note.

A rank's kernel writes its log itself: its stdout and stderr *are* the log file (opened
``O_APPEND``), so Python output echoed by the kernel, native output (NCCL, C++ ``printf``),
faulthandler's crash reports and whatever the rank's children print all land there, and so does
a warm spare's output once it has become the rank (it re-points its descriptors at the rank's
log). Nothing copies output in between, and nothing should: a copier would make the kernel's
writes wait on it, and would have to be told of a spare's switch. Left alone, though, a runaway
``while True: print(...)`` fills the disk at the speed the kernel can write.

So the rank's supervisor (:mod:`.supervisor`: no user code, always free to act, polling anyway)
watches the file its kernel's descriptors 1 and 2 point to (``/proc/PID/fd/1``, which follows a
spare that became the rank) with a :class:`Watcher`. Once that file passes half the cap,
:func:`rotate` copies it to ``PATH.1`` (replacing the previous ``PATH.1``, which is the part
dropped) and truncates it to nothing: a copy-truncate, because the writers keep their
descriptors (renaming the file would leave them writing into the renamed one). With ``O_APPEND``
every later write lands at the new end. ``PATH.1`` then starts with one line saying how many
bytes of the oldest output were dropped so far, and the readers (:func:`read_bytes`, used by
``%clorch logs``, the report of a dead rank and batch jobs' logs) read ``PATH.1`` and ``PATH``
as one log. On disk the two stay under the cap plus what the kernel writes between two looks
(the supervisor looks every 20 ms while the log grows).

One known gap, the same as logrotate's ``copytruncate``: what a writer appends between the copy's
last read and the truncation (microseconds) is lost. It happens only under a flood past half the
cap, and only at a rotation. A reader during a rotation may see its newest output twice (the copy
is ``PATH.1`` before the log is emptied), never none of it.

Standard library only: the supervisor runs with ``python -I -S`` and imports this module from
its own directory.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from typing import Any, Mapping

try:
    from ..common import env_vars
except ImportError:  # imported by the supervisor run as a script (python -I -S), which puts common/ on sys.path
    import env_vars  # type: ignore[no-redef]

logger = logging.getLogger(__name__)

#: The environment variable (of the notebook, or of the nanny's host) that sets a rank's log cap
#: at ``%clorch start``: bytes, ``k``/``M``/``G`` suffixes, ``0`` for no cap.
CAP_ENV = env_vars.LOG_CAP.name
#: The default cap of one rank's log on disk: 64 MiB (the newest 32 to 64 MiB are kept).
DEFAULT_CAP = int(env_vars.LOG_CAP.default or 0)
#: The smallest cap accepted: below it a rotation would copy on nearly every look.
MIN_CAP = 64 * 1024
#: How often the supervisor looks at the log while it grows, and while it does not.
FAST_POLL_S = 0.02
SLOW_POLL_S = 0.1
_CHUNK = 1 << 20
_MARKER = re.compile(rb"^--- clorch_repl: (\d+) bytes of this log's oldest output were dropped")


def parse_cap(raw: str) -> int:
    """``"64M"`` -> 67108864; ``""`` -> :data:`DEFAULT_CAP`; ``"0"`` -> 0 (no cap). ValueError
    names :data:`CAP_ENV` for what cannot be read or is under :data:`MIN_CAP`."""
    raw = raw.strip()
    if not raw:
        return DEFAULT_CAP
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}.get(raw[-1].lower(), 1)
    try:
        value = int(float(raw[:-1] if scale != 1 else raw) * scale)
    except ValueError:
        raise ValueError(f"{CAP_ENV}={raw!r} is not a size: give bytes, e.g. 64M, 512k, or 0 for no cap") from None
    if value != 0 and value < MIN_CAP:
        raise ValueError(f"{CAP_ENV}={raw!r} is below the smallest cap of {MIN_CAP // 1024} KiB (0: no cap)")
    return value


def cap_from_env(environ: Mapping[str, str]) -> int:
    """The cap a rank started now gets (see :data:`CAP_ENV`)."""
    return parse_cap(environ.get(CAP_ENV, ""))


def older_path(path: str) -> str:
    """Where the older half of the log at ``path`` lies after a rotation."""
    return path + ".1"


def marker(dropped: int, cap: int) -> bytes:
    """The first line of ``PATH.1``: how much of the oldest output is gone, and why."""
    return (f"--- clorch_repl: {dropped} bytes of this log's oldest output were dropped "
            f"({_size(dropped)}; the log keeps at most {_size(cap)} per rank: set {CAP_ENV} before "
            f"%clorch start to change that) ---\n").encode()


def dropped_bytes(path: str) -> int:
    """How many bytes of the log at ``path`` were dropped so far (0 when none were)."""
    try:
        with open(older_path(path), "rb") as fh:
            first = fh.readline(512)
    except FileNotFoundError:
        return 0
    found = _MARKER.match(first)
    return int(found.group(1)) if found else 0


def rotate(path: str, cap: int) -> int:
    """Move the log at ``path`` into ``PATH.1`` and truncate it, when it holds more than half of
    ``cap``; returns the bytes this rotation dropped (the previous ``PATH.1``), -1 when it did not
    rotate. The log keeps being written while this runs: the copy reads until it has caught up."""
    half = cap // 2
    try:
        if cap <= 0 or os.stat(path).st_size <= half:
            return -1
    except FileNotFoundError:
        return -1
    older = older_path(path)
    dropped_now = 0
    try:
        dropped_now = os.stat(older).st_size - len(_first_marker(older))
    except FileNotFoundError:
        pass
    dropped = dropped_bytes(path) + dropped_now
    tmp = older + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with open(fd, "wb") as out, open(path, "rb") as log:
            if dropped:
                out.write(marker(dropped, cap))
            _copy(log, out)
            out.flush()
            # The copy becomes PATH.1 before the log is emptied, and the copy goes on in the same
            # file: a reader always finds the newest output in one of the two. Renamed after the
            # truncation (as before), a reader between the two found the log empty and no PATH.1
            # (a first rotation): `%clorch logs --tail 3` showed one empty line (test_abuse.py, once).
            os.replace(tmp, older)
            _copy(log, out)  # what came meanwhile
            out.flush()
            os.truncate(path, 0)  # right after the read that found the end: the window is tiny
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return dropped_now


def _copy(src: Any, dst: Any) -> None:
    """The rest of ``src`` into ``dst``, up to the end it finds."""
    while True:
        chunk = src.read(_CHUNK)
        if not chunk:
            return
        dst.write(chunk)


def _first_marker(path: str) -> bytes:
    with open(path, "rb") as fh:
        first = fh.readline(512)
    return first if _MARKER.match(first) else b""


def read_bytes(path: str, max_bytes: int | None) -> bytes:
    """The last ``max_bytes`` (None: all) of the log at ``path``, its older half ``PATH.1``
    (starting with its note on what was dropped) read first: one log across a rotation.
    FileNotFoundError when neither file exists."""
    parts: list[bytes] = []
    want = max_bytes
    for name in (path, older_path(path)):
        try:
            with open(name, "rb") as fh:
                size = fh.seek(0, os.SEEK_END)
                start = 0 if want is None else max(0, size - want)
                fh.seek(start)
                data = fh.read(size - start)
        except FileNotFoundError:
            if name == path and not os.path.exists(older_path(path)):
                raise
            continue
        parts.append(data)
        if want is not None:
            want -= len(data)
            if want <= 0:
                break
    return b"".join(reversed(parts))


def note(path: str) -> str:
    """One line for the top of what a reader shows when the log lost its oldest part, else ""."""
    dropped = dropped_bytes(path)
    if not dropped:
        return ""
    return f"[clorch_repl: the oldest {_size(dropped)} ({dropped} bytes) of this log were dropped to keep it under its cap ({CAP_ENV})]\n"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


class Watcher:
    """The supervisor's look at its kernel's log: :meth:`check` rotates what passed half the cap
    and says how long to wait before the next look (sooner while the log grows)."""

    def __init__(self, pid: int, cap: int) -> None:
        self.pid = pid
        self.cap = cap
        self._last: dict[int, int] = {}  # inode -> size at the last look
        #: why the last rotation failed (said once in the log, not at every look); None when none did
        self.error: str | None = None

    def check(self) -> float:
        if self.cap <= 0 or self.pid <= 0:
            return SLOW_POLL_S
        grew = False
        seen: set[int] = set()
        for fd in (1, 2):
            link = f"/proc/{self.pid}/fd/{fd}"
            try:
                st = os.stat(link)
            except OSError:  # the kernel is gone, or the descriptor is closed
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            grew = grew or st.st_size != self._last.get(st.st_ino)
            self._last[st.st_ino] = st.st_size
            if st.st_size > self.cap // 2:
                try:
                    path = os.readlink(link)
                    if not path.endswith(" (deleted)"):
                        rotate(path, self.cap)
                        self._last[st.st_ino] = 0
                except OSError as exc:  # a full disk, a log removed: the rank goes on regardless
                    self._failed(exc)
        return FAST_POLL_S if grew else SLOW_POLL_S

    def _failed(self, exc: OSError) -> None:
        if self.error is not None:
            return
        self.error = str(exc)
        try:
            os.write(2, f"clorch supervisor: could not rotate the rank's log: {exc}\n".encode())
        except OSError as again:  # the log itself cannot be written (the disk is full): keep it here
            self.error += f" (nor say so in the log: {again})"
