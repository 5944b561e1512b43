"""A forked rank's command line as ``ps`` and ``/proc/PID/cmdline`` show it (issue 39).

A rank forked from the zygote (:mod:`.zygote`) runs no new program, so without this it would show
the zygote's command line: ``ps``, ``htop``, and whoever finds the ranks by their command
(``-m clorch_repl.kernel.app``, the supervisor's ``supervisor.py``) would no longer see what runs.
This writes the command the rank stands for into the process's own argument area, as
setproctitle(3) does: the text, a NUL, and the rest of the area filled with spaces, so that its
last byte is not NUL, which tells Linux to show the text up to its first NUL. The zygote is
started with room to spare (:data:`ROOM`).
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

#: the argument the zygote is started with to leave room for its ranks' command lines (Linux shows
#: at most a page of a rewritten one)
ROOM = "#" * 3800


def _arg_area() -> tuple[int, int]:
    """This process's argument area: fields 48 and 49 of /proc/self/stat (Linux 3.5+)."""
    with open("/proc/self/stat", "rb") as fh:
        stat = fh.read()
    fields = stat[stat.rfind(b")") + 2:].split()  # from field 3 on: field N is fields[N - 3]
    return int(fields[45]), int(fields[46])


def set_cmdline(argv: list[str]) -> bool:
    """Show ``argv`` as this process's command line; False where it does not fit (left as it was)."""
    try:
        start, end = _arg_area()
    except (OSError, ValueError, IndexError) as exc:
        logger.debug("no argument area to rewrite: %s", exc)
        return False
    title = " ".join(argv).encode() + b"\0"
    if len(title) >= end - start or len(title) > 4000:
        return False
    ctypes.memmove(start, title.ljust(end - start, b" "), end - start)
    return True
