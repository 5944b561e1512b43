"""A rank's tracebacks without clorch_repl's own frames: an error raised inside the package's
code on the user's behalf (a refused ``input()``, a Ctrl-C that lands while a print is being
counted, torchrun code's ``init_process_group`` refused, a ``%clorch run`` script's own error) is
shown ending at the user's line, as in a plain kernel.

``__tracebackhide__`` cannot do it: IPython (9.x ultratb) never hides the frame an exception was
raised in. IPython's showtraceback uses an exception's ``_render_traceback_`` instead of its own
formatting when there is one, so the error carries one that formats the traceback minus the
given files' frames with the shell's own formatter (same colours, same ``Cell In[n]`` lines).
The traceback is read when it is shown, complete by then. The exception's type is unchanged.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any, Callable, Iterable, TypeVar

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def without_frames(tb: types.TracebackType | None, files: Iterable[str]) -> types.TracebackType | None:
    """``tb`` with the frames of ``files`` left out (a new chain; the frames are the same)."""
    skip = set(files)
    kept: list[types.TracebackType] = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename not in skip:
            kept.append(tb)
        tb = tb.tb_next
    chain: types.TracebackType | None = None
    for entry in reversed(kept):
        chain = types.TracebackType(chain, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return chain


def _rendered(error: BaseException, shell: Any,
              cut: Callable[[types.TracebackType | None], types.TracebackType | None]) -> BaseException:
    """``error``, rendered by ``shell`` with its traceback as ``cut`` leaves it (read when shown);
    an error whose class renders itself (:class:`~clorch_repl.errors.ScriptExit`'s one line) keeps that."""
    if getattr(type(error), "_render_traceback_", None) is not None:
        return error

    def render() -> list[str]:
        tb = cut(error.__traceback__)
        if tb is not None:
            # %debug (%clorch debug) opens the innermost frame of the error's traceback: the user's
            # line, not the clorch_repl code that raised on the user's behalf
            error.__traceback__ = tb
            if getattr(sys, "last_value", None) is error:
                sys.last_traceback = tb
        return shell.InteractiveTB.structured_traceback(type(error), error, tb)

    error._render_traceback_ = render  # type: ignore[attr-defined]
    return error


def shown_without(error: BaseException, shell: Any, files: Iterable[str]) -> BaseException:
    """``error``, rendered by ``shell`` without the frames of ``files`` (see the module docstring).
    The files are remembered on the error, so that a later :func:`hide_own_frames` (the request
    or the script the error then leaves) cuts them too instead of bringing them back."""
    skip = (*_skipped(error), *files)
    try:
        error._clorch_skipped = skip  # type: ignore[attr-defined]
    except AttributeError:  # a built-in type with slots: rendered below with these files only
        logger.debug("cannot remember the frames cut from %s", type(error).__name__)
    return _rendered(error, shell, lambda tb: without_frames(tb, skip))


def _skipped(error: BaseException) -> tuple[str, ...]:
    return getattr(error, "_clorch_skipped", ())


def interrupts_at_users_line(method: F, file: str) -> F:
    """``method`` (of code in ``file`` that user code calls into, such as a stream's ``write``),
    with a KeyboardInterrupt that lands inside it shown without the frames of ``file`` and of
    this module: Ctrl-C in a print loop then ends at the user's ``print`` line."""
    skip = (file, __file__)

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            return method(*args, **kwargs)
        except KeyboardInterrupt as exc:
            from IPython import get_ipython

            shell = get_ipython()
            if shell is not None:  # a rank's kernel: always, once it runs cells
                shown_without(exc, shell, skip)
            raise

    return wrapper  # type: ignore[return-value]


#: files whose frames a user's traceback leaves out (:func:`hide_frames_of`)
_HIDDEN: set[str] = set()
#: of those, files that run the user's code (the ``%clorch run`` runner): what lies above their
#: first frame (the request's one-line cell) is not the user's either
_RUNNERS: set[str] = set()


def hide_frames_of(file: str, runner: bool = False) -> None:
    """Leave ``file``'s frames out of what :func:`hide_own_frames` shows; ``runner``: also every
    frame above its first one. A module registers itself when it is loaded, so a module no rank
    loaded is never looked for (and none of these modules imports another for its file name)."""
    _HIDDEN.add(file)
    if runner:
        _RUNNERS.add(file)


def user_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """``tb`` as the user wrote it: without the registered files' frames and, for code that
    ``%clorch run`` ran, without the frames above the script (the request's one-line cell)."""
    start = tb
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in _RUNNERS:
            start = tb
            break
        tb = tb.tb_next
    return without_frames(start, _HIDDEN)


def hide_own_frames(error: BaseException) -> BaseException:
    """``error``, rendered by the rank's shell without clorch's frames (see the module docstring).
    An exception that takes no attributes keeps IPython's own rendering."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return error
    try:
        _rendered(error, shell, lambda tb: without_frames(user_traceback(tb), _skipped(error)))
    except (AttributeError, TypeError) as exc:  # a built-in type with slots: shown with our frames
        logger.debug("cannot shorten the traceback of %s: %s", type(error).__name__, exc)
    return error
