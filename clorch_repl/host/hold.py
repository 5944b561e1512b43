"""The hold of a detached session: what lets local ranks outlive the notebook kernel that started them.

Why a file the supervisors read, rather than a new process or a message: a rank's supervisor
(:mod:`.supervisor`) is already the one process that watches the notebook and ends the rank when
it is gone, and it must go on doing exactly that for a session nobody detached (no orphans). So
the rule stays the supervisor's, and ``%clorch detach`` only leaves it a note in the session's
private directory (0700): ``hold.json``, naming the kernel that drives the session now (its pid
and the kernel's start time, so that a reused pid is never taken for it), how long the ranks are
kept once no such kernel is alive, and the session file to remove when they end. A supervisor
reads it (:class:`Watcher`, every half second) and keeps its rank while :func:`decide` says so;
when it no longer does (no hold, or no owner alive for ``keep_for_s``), it ends the rank as it
always did and removes the session's directory and session file. ``%clorch connect`` rewrites the
hold with the new kernel as owner, which is how a second kernel keeps the ranks alive.

While no owner is alive, each supervisor writes the time it noticed into ``hold.unowned``, so
that ``%clorch sessions`` can say how long the session has been idle and until when it is kept.

Standard library only: the supervisor imports it as a script (``python -I -S``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

HOLD_NAME = "hold.json"
UNOWNED_NAME = "hold.unowned"
#: How often a supervisor whose notebook is gone reads the hold again (a new owner, a stop).
READ_EVERY_S = 0.5


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22), which
    tells a live process from a later one that reuses its pid; None when it is not running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has ended
        return None
    return int(fields[19])


def owner_alive(hold: dict[str, Any]) -> bool:
    """Whether the kernel the hold names still runs (the same process, not a reused pid)."""
    start = process_start(int(hold.get("owner_pid", 0)))
    return start is not None and start == hold.get("owner_start")


def decide(hold: dict[str, Any] | None, parent_alive: bool, alive: bool, unowned_since: float | None,
           now: float, *, was_held: bool = False) -> tuple[bool, float | None]:
    """The hold rule, pure: whether the rank is kept, and since when no owner is alive (None
    while one is). No hold: kept while its parent (the notebook that started it) lives, as
    always. With a hold the parent no longer matters (a kernel that was taken over may live on
    without driving anything): kept while the owner ``alive``, then until ``keep_for_s`` after
    the first time no owner was seen. A hold that was there and is gone (``was_held``) means the
    session is over (another rank's supervisor ended first and removed the directory): ended,
    whoever the parent is."""
    if hold is None:
        return parent_alive and not was_held, None
    if alive:
        return True, None
    since = now if unowned_since is None else unowned_since
    return now - since < float(hold.get("keep_for_s", 0.0)), since


def write(session_dir: str, owner_pid: int, keep_for_s: float, session_file: str) -> dict[str, Any]:
    """Write (atomically, 0600) the hold naming ``owner_pid`` as the kernel that drives the session."""
    hold = {"owner_pid": owner_pid, "owner_start": process_start(owner_pid), "keep_for_s": float(keep_for_s),
            "session_file": session_file, "written_at": time.time()}
    write_private(os.path.join(session_dir, HOLD_NAME), json.dumps(hold))
    try:
        os.unlink(os.path.join(session_dir, UNOWNED_NAME))
    except FileNotFoundError:
        pass
    return hold


def read(session_dir: str) -> dict[str, Any] | None:
    """The hold, or None when there is none (or it cannot be read: no hold is the safe reading,
    since it ends the ranks as an undetached session's)."""
    try:
        with open(os.path.join(session_dir, HOLD_NAME)) as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def unowned_since(session_dir: str) -> float | None:
    """time.time() since which no owner of the session has been alive (None: one is, or unknown)."""
    try:
        with open(os.path.join(session_dir, UNOWNED_NAME)) as fh:
            return float(fh.read().strip())
    except (OSError, ValueError):
        return None


def write_private(path: str, text: str) -> None:
    """``text`` as the file ``path`` (0600), replaced in one step so that a reader never sees half
    of it (the supervisor's pid and exit files use it too: it imports this module as a sibling).
    Not fsynced: small files that live processes read, which nothing reads after a power cut. The
    temporary name carries the pid, so two writers never share it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


class Watcher:
    """A supervisor's view of its session's hold (see the module docstring): asked every poll
    once the notebook is gone; reads the file at most every :data:`READ_EVERY_S`."""

    def __init__(self, session_dir: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.session_dir = session_dir
        self.hold: dict[str, Any] | None = None
        self._clock = clock
        self._read_at = float("-inf")
        self._since: float | None = None
        #: whether a hold was ever read: once there, its disappearance ends the rank
        self._was_held = False

    def keep(self, parent_alive: bool) -> bool:
        """Whether to keep the rank (:func:`decide`); ``parent_alive``: whether the notebook that
        started it lives. Without a session directory only the parent counts, as before holds."""
        if not self.session_dir:
            return parent_alive
        now = self._clock()
        if now - self._read_at < READ_EVERY_S:
            alive = self._since is None and self.hold is not None
            if decide(self.hold, parent_alive, alive, self._since, now, was_held=self._was_held)[0]:
                return True
            # never end a rank on a stale reading: the hold may have been written since (a
            # notebook killed right after %clorch detach)
        self._read_at = now
        self.hold = read(self.session_dir)
        if self.hold is None and self._was_held and os.path.exists(os.path.join(self.session_dir, HOLD_NAME)):
            return True  # there but unreadable this once: read again before ending anything
        alive = self.hold is not None and owner_alive(self.hold)
        was = self._since
        kept, self._since = decide(self.hold, parent_alive, alive, self._since, now, was_held=self._was_held)
        self._was_held = self._was_held or self.hold is not None
        if was is None and self._since is not None:  # for %clorch sessions: idle since
            try:
                write_private(os.path.join(self.session_dir, UNOWNED_NAME), str(time.time()))
            except OSError:
                pass  # the directory is going; the decision stands
        return kept

    @property
    def was_held(self) -> bool:
        """Whether this rank's session was ever detached."""
        return self._was_held

    def remove_session_file(self) -> None:
        """Remove the session file the hold names, once the ranks have ended."""
        if self.session_dir:
            remove_session_file(str((self.hold or {}).get("session_file") or ""), self.session_dir)


def remove_session_file(path: str, session_dir: str) -> bool:
    """Remove the session file ``path`` if it still names ``session_dir`` (a later session of
    the same name is not this one's to remove); whether it was removed."""
    if not path:
        return False
    try:
        with open(path) as fh:
            named = json.load(fh).get("dir")
    except (OSError, ValueError, AttributeError):
        return False
    if named != session_dir:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False  # another rank's supervisor removed it first
    return True
