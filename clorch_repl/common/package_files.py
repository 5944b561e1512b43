"""Which source files are clorch_repl's own: the one answer for every place that leaves the
package's frames out of what a user sees (:mod:`.user_frames` for the public functions' errors,
:mod:`clorch_repl.diagnosis.probe` for the stacks of a hang report).

Decided by the frame's file, resolved through symbolic links (an editable or linked install shows
the same files under two paths), never by the text shown for it. A leaf: it imports nothing.
"""

from __future__ import annotations

import functools
import os

#: the package's folder, resolved, with a trailing separator (so that ``clorch_repl_x/`` is not inside)
PACKAGE_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


@functools.lru_cache(maxsize=4096)
def is_package_file(filename: str) -> bool:
    """Whether code from ``filename`` (a code object's ``co_filename``) is clorch_repl's own.
    Pseudo-files (``<string>``, ``<ipython-input-...>``) never are. Cached: a stack's frames
    repeat the same few files, and resolving links costs a system call per path component."""
    if not filename or filename.startswith("<"):
        return False
    return os.path.realpath(filename).startswith(PACKAGE_DIR)
