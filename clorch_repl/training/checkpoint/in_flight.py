"""The asynchronous save in flight on this rank: its handle, its thread, and the rule that one
save (or load) waits for the one before.

``save_checkpoint(..., async_save=True)`` returns a :class:`CheckpointSave` once the state is
staged in host memory; a thread writes and commits it (collectives on the checkpoint group only,
see :mod:`.ranks`). A rank runs one save at a time: the next save or load first waits for the one in
flight (:func:`wait_for_previous`), so its buffers are never overwritten while being written and
two commits never race. :func:`in_flight` is what ``%clorch status`` shows.

An error of the background write is raised by ``wait()``. A failed save nobody waited for is not
lost either: the next save or load warns with its message before starting.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Callable

from ...errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["CheckpointSave", "start", "wait_for_previous", "finish", "in_flight"]


class CheckpointSave:
    """Handle of an asynchronous :func:`~clorch_repl.distributed.save_checkpoint`.

    The checkpoint holds the state at the call; training may change the weights as soon as the
    call returned. ``wait()`` blocks until the checkpoint is committed at ``path`` and returns it,
    or raises the background write's CheckpointError (on every rank alike: the ranks agree on the
    outcome before it is known); ``done()`` says whether it has finished either way."""

    def __init__(self, path: str, staged_s: float) -> None:
        self.path = path
        #: how long the call blocked training (state copied to host memory), in seconds
        self.staged_s = staged_s
        self.started_at = time.time()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._reported = False
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the write has finished (committed or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> str:
        """The committed checkpoint's path; raises its error, or TimeoutError after ``timeout`` s."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the asynchronous save to {self.path} is still writing after {timeout} s")
        if self._error is not None:
            self._reported = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        if not self.done():
            state = f"writing for {time.time() - self.started_at:.1f} s"
        else:
            state = "failed" if self._error is not None else "committed"
        return f"<CheckpointSave {self.path}: {state}>"

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except CheckpointError as exc:
            self._error = exc
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), which raises it; logged here
            logger.exception("the asynchronous save to %s failed", self.path)
            self._error = CheckpointError(f"the asynchronous save to {self.path} failed: "
                                          f"{type(exc).__name__}: {exc}")
        finally:
            self._done.set()


_current: CheckpointSave | None = None
_lock = threading.Lock()


def start(path: str, staged_s: float, write: Callable[[], Any]) -> CheckpointSave:
    """Run ``write`` on a thread of its own; the handle is this rank's save in flight."""
    global _current
    handle = CheckpointSave(path, staged_s)
    # A daemon: a rank that ends (%clorch stop) does not wait for it; the commit has not happened
    # then, so the previous checkpoint stays whole at the path and the next save clears the rest.
    thread = threading.Thread(target=handle._run, args=(write,), name="clorch-checkpoint-save", daemon=True)
    handle._thread = thread
    with _lock:
        _current = handle
    thread.start()
    return handle


def _untold_error() -> BaseException | None:
    """Wait for this rank's save in flight, if any; its error if it failed and nobody was told
    (marked told from now on)."""
    with _lock:
        handle = _current
    if handle is None:
        return None
    handle._done.wait()
    if handle._error is None or handle._reported:
        return None
    handle._reported = True
    return handle._error


def wait_for_previous() -> None:
    """Wait for this rank's save in flight, if any; warn if it failed and nobody was told."""
    error = _untold_error()
    if error is not None:
        warnings.warn(f"an earlier asynchronous save failed and was never waited for: {error}",
                      RuntimeWarning, stacklevel=3)


def finish() -> None:
    """This rank's save in flight, waited for before the rank ends politely (the notebook's
    request ``finish_saves``: clorch_repl.session.saves says why); its error raised, if it failed
    and nobody was told."""
    error = _untold_error()
    if error is not None:
        raise error


def in_flight() -> list[dict[str, Any]]:
    """This rank's save still writing, as plain data (``%clorch status``)."""
    with _lock:
        handle = _current
    if handle is None or handle.done():
        return []
    return [{"path": handle.path, "for_s": round(time.time() - handle.started_at, 1)}]
