"""Errors of the package's public functions shown ending at the user's call.

``save_checkpoint``, ``load_checkpoint``, ``launch`` and a job's ``wait`` refuse bad input and
report failures with one of the package's own errors (:class:`~clorch_repl.errors.ClorchError`),
raised several calls deep inside clorch_repl. In IPython (a rank, the notebook kernel) the
traceback would show three or four of clorch_repl's frames before the message, which are no use to
the user, and ``%debug`` (``%clorch debug`` on a rank) would open in the innermost of them. A
function wrapped with :func:`public` gives such an error IPython's ``_render_traceback_``: the
traceback without clorch_repl's frames, rendered by the shell's own formatter (as
:mod:`clorch_repl.kernel.tracebacks` does for errors raised on the user's behalf in a rank), and
the error's ``__traceback__`` cut the same way when it is shown, so that the post-mortem debugger
opens at the user's line. The frames of the standard library's :mod:`contextlib` that run one of
clorch's own context managers (``with agreed(...)`` around a checkpoint's checks) go with them: they
are clorch's machinery too, and they differ between ranks (``__exit__`` throwing into the generator
on the rank that failed, ``next()`` on the ranks that were told), which kept the session from merging
the ranks' otherwise identical tracebacks. Other exceptions (torch's, the user's own code called
back) keep every frame: there clorch's frames may be the clue. Outside IPython nothing changes.

A leaf: it imports nothing of the package but :mod:`clorch_repl.errors`, and IPython only when
IPython is already running.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types
from typing import Any, Callable, TypeVar

from ..errors import ClorchError
from .package_files import is_package_file

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


#: the file of the standard library's contextlib, as its code objects name it
_CONTEXTLIB_FILE = contextlib.__file__


def _runs_packages_context_manager(entry: types.TracebackType) -> bool:
    """Whether ``entry`` is a frame of contextlib running one of clorch_repl's context managers: the
    next frame below it that is not contextlib's (``ExitStack`` calls ``__exit__``, which throws into
    the generator) is the package's own. A contextlib frame running the user's generator is kept."""
    below: types.TracebackType | None = entry
    while below is not None and below.tb_frame.f_code.co_filename == _CONTEXTLIB_FILE:
        below = below.tb_next
    return below is not None and entry is not below and is_package_file(below.tb_frame.f_code.co_filename)


def users_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` without clorch_repl's frames, nor contextlib's that run clorch_repl's context managers
    (a new chain of the same frames); ``tb`` itself when nothing else is left (an error of the
    package's own machinery keeps its frames)."""
    kept: list[types.TracebackType] = []
    entry = tb
    while entry is not None:
        code_file = entry.tb_frame.f_code.co_filename
        if not is_package_file(code_file) and not _runs_packages_context_manager(entry):
            kept.append(entry)
        entry = entry.tb_next
    if not kept:
        return tb
    chain: types.TracebackType | None = None
    for item in reversed(kept):
        chain = types.TracebackType(chain, item.tb_frame, item.tb_lasti, item.tb_lineno)
    return chain


def users_stacklevel() -> int:
    """The ``stacklevel`` that makes :func:`warnings.warn`, called in the caller's own frame, name the
    user's line that called into clorch_repl rather than clorch's own (nor contextlib's running it):
    the same frames :func:`users_frames` leaves out, walked outwards. How deep that line is differs
    between callers (a sharded load is a call deeper than a single-file one), so it is counted."""
    frame = sys._getframe(1)  # the frame that calls warnings.warn: its stacklevel 1
    level = 1
    while frame is not None and (is_package_file(frame.f_code.co_filename)
                                 or frame.f_code.co_filename == _CONTEXTLIB_FILE):
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1


def shown_from_users_code(error: BaseException) -> BaseException:
    """``error`` rendered, when IPython shows it, without clorch_repl's frames (module docstring)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or hasattr(error, "_render_traceback_"):
        return error  # not in IPython, or already rendered by the rank's own rules

    def render() -> list[str]:
        tb = users_frames(error.__traceback__)
        error.__traceback__ = tb  # %debug and %clorch debug open at the user's line
        if getattr(sys, "last_value", None) is error:  # IPython stored it before rendering
            sys.last_traceback = tb
        return shell.InteractiveTB.structured_traceback(type(error), error, tb)

    try:
        error._render_traceback_ = render  # type: ignore[attr-defined]
    except AttributeError as exc:  # a type that takes no attributes: IPython's own rendering
        logger.debug("cannot shorten the traceback of %s: %s", type(error).__name__, exc)
    return error


def public(function: F) -> F:
    """``function``, whose :class:`ClorchError` is shown from the user's frames (module docstring)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ClorchError as exc:
            shown_from_users_code(exc)
            raise

    return wrapper  # type: ignore[return-value]
