"""The rank's kernel class: ipykernel's ``IPythonKernel`` with what a rank adds.

``RankKernel`` is named in :data:`clorch_repl.kernel.app.KERNEL_OPTIONS` (ipykernel's
``kernel_class``), so only a rank imports this module, and ipykernel is imported at module level.
It composes the rank's additions, each in its own module: the stdin policy
(:mod:`.stdin_policy`), the lean execute path (:mod:`.lean_execute`), the output budget around
each cell (:mod:`.output`), displays echoed to the log and widget views brought up to date at
a cell's end (:mod:`.display_log`) and the
``breakpoint()`` hook (:mod:`.breakpoints`), and a rank that is not interactive to libraries
that ask (:mod:`.worker_look`), and every cell named in a folder all the user's ranks share
(:mod:`.cell_files`: a warning from a cell then reads the same on every rank, and merges). Here:
the cell's traceback written to the rank's log,
no status messages for the notebook's probes, and five savings of a rank's CPU per cell
(:func:`_memoize_accepts_parameters`, :func:`_memoize_cell_hash`, :class:`_TransformOnce`,
:func:`cheap_async_check`, and IPython's static transforms remembered per cell text,
:mod:`.transform_memo`).
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any

from ipykernel import compiler, ipkernel
from ipykernel.ipkernel import IPythonKernel
from traitlets import Type

from ..wire.probe import PROBE_REQUEST
from ..wire.limits import Limits, at_source
from . import breakpoints, cell_files, exit_guard, output, transform_memo
from .shell_recv import one_task_per_request
from .display_log import log_displays, log_widget_states, publish_widget_views
from .lean_execute import LeanExecute
from .stdin_policy import StdinPolicy
from .worker_look import look_like_a_worker

logger = logging.getLogger(__name__)


class RankKernel(StdinPolicy, LeanExecute, IPythonKernel):
    """ipykernel's kernel, marking when a cell runs (for RankOutStream) and writing a failed
    cell's traceback into the rank's log, where ipykernel writes only the iopub message."""

    #: writes a cell's file for the debugger whole: every rank of the user's shares the folder
    debugger_class = Type(cell_files.RankDebugger, klass=cell_files.Debugger)

    def __init__(self, **kwargs: Any) -> None:
        cell_files.cell_directory()  # checked now: a refused folder is said in the rank's log, not in a cell
        super().__init__(**kwargs)
        look_like_a_worker()  # after the shell set sys.ps1: Lightning's ddp refuses a rank with it
        breakpoints.install()  # after ipykernel imported debugpy, which replaces the hook
        cheap_async_check(self.shell)
        transform_memo.install(self.shell)
        exit_guard.install(self.shell)
        self._count_iopub()
        log_displays(self)

    def start(self) -> None:
        """ipykernel's, with each shell request taken as one task (:mod:`.shell_recv`)."""
        super().start()
        one_task_per_request(self)

    def _publish_status(self, status, channel, parent=None):  # type: ignore[no-untyped-def]
        """No busy/idle on iopub for the notebook's probes (the hang check, ``%clorch top``
        once a second): nothing reads them, and published from the control thread while the
        main thread's cell output went out they arrived split in two at the relay (seen with
        a probe every 0.2 s: the status's frames, then its delimiter alone)."""
        header = ((parent or self.get_parent(channel)) or {}).get("header") or {}
        if header.get("msg_type") == PROBE_REQUEST:
            return
        super()._publish_status(status, channel, parent)

    async def do_execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        """ipykernel's, inside the cell's output budget (:mod:`.output`), with a failed cell's
        traceback echoed to the rank's log."""
        limits, self._next_limits = self._next_limits, None
        silent = bool(kwargs.get("silent", args[1] if len(args) > 1 else False))
        output.start_cell(at_source(limits or Limits()), silent)  # see flood.at_source
        transform = _TransformOnce(self.shell)
        try:
            reply = await super().do_execute(*args, **kwargs)
        finally:
            transform.close()
            output.end_cell()
            publish_widget_views()  # a finished bar's last text, for front ends without a widget manager
            log_widget_states()  # a finished bar's last state, for %clorch logs
        if isinstance(reply, dict) and reply.get("status") == "error":
            try:
                sys.stdout.flush()
                sys.stderr.flush()
                text = "\n".join(reply.get("traceback") or [f"{reply.get('ename')}: {reply.get('evalue')}"])
                sys.__stderr__.write(text + "\n")
                sys.__stderr__.flush()
            except (OSError, ValueError) as exc:  # the log is gone: nothing to write it to
                self.log.debug("could not write the traceback to the rank's log: %s", exc)
        return reply


def _memoize_accepts_parameters(ipkernel: types.ModuleType) -> None:
    """ipykernel asks ``inspect.signature`` of IPython's run_cell, every cell, which keyword
    arguments it takes (about 30 us of a rank's CPU per cell): remember the answer per function.
    An ipykernel without the helper is left as it is."""
    ask = getattr(ipkernel, "_accepts_parameters", None)
    if ask is None or getattr(ask, "_clorch_memo", False):
        return
    answers: dict[tuple, dict] = {}

    def accepts_parameters(meth, param_names):  # type: ignore[no-untyped-def]
        key = (getattr(meth, "__func__", meth), tuple(param_names))
        try:
            answer = answers[key]
        except KeyError:
            answer = answers[key] = ask(meth, param_names)
        except TypeError:  # unhashable: ask every time
            return ask(meth, param_names)
        return dict(answer)

    accepts_parameters._clorch_memo = True  # type: ignore[attr-defined]
    ipkernel._accepts_parameters = accepts_parameters


#: cells longer than this are hashed every time (what is remembered is kept in memory)
HASHED_CHARS = 256 * 1024


def _memoize_cell_hash(compiler: types.ModuleType) -> None:
    """ipykernel names every cell's code after a murmur2 hash of its text (the file name in its
    tracebacks and for the debugger, ``compiler.get_file_name``), computed in pure Python a byte
    at a time: 2.8 us for ``pass``, 354 us for a 63-line cell of 3,000 characters (hot loop, the
    2-core box), on every rank for every cell. The hash is a function of the text and the seed
    alone: remembered for the 64 most recent texts, so a cell run again is named without it,
    with the same name as before. An ipykernel without the function is left as it is."""
    murmur = getattr(compiler, "murmur2_x86", None)
    if murmur is None or getattr(murmur, "_clorch_memo", False):
        return
    remembered = functools.lru_cache(maxsize=64)(murmur)

    def murmur2_x86(data, seed):  # type: ignore[no-untyped-def]
        if isinstance(data, str) and len(data) <= HASHED_CHARS and isinstance(seed, int):
            return remembered(data, seed)
        return murmur(data, seed)

    murmur2_x86._clorch_memo = True  # type: ignore[attr-defined]
    compiler.murmur2_x86 = murmur2_x86


def cheap_async_check(shell: Any) -> None:
    """IPython learns whether a cell holds top-level ``await`` (and must run as a coroutine) by
    compiling the whole cell, and asks twice per cell (ipykernel's do_execute, then run_cell),
    before compiling it a third time to run it: 1.5 ms each for a 90-line cell on the 2-core box.
    Only ``await``, ``async for``, ``async with`` and async comprehensions make a cell a coroutine,
    and each is spelled with one of the two words: a cell whose transformed text holds neither is
    answered False without compiling; any other cell is asked of IPython's own check, so the answer
    is IPython's for every cell (tests/unit/test_rank_async_check.py holds it to that)."""
    if shell is None or "should_run_async" in vars(shell):
        return
    ask = shell.should_run_async

    def should_run_async(raw_cell: str, *, transformed_cell: str | None = None,
                         preprocessing_exc_tuple: Any = None) -> bool:
        if isinstance(transformed_cell, str) and "await" not in transformed_cell and "async" not in transformed_cell:
            return False
        return ask(raw_cell, transformed_cell=transformed_cell, preprocessing_exc_tuple=preprocessing_exc_tuple)

    shell.should_run_async = should_run_async


class _TransformOnce:
    """ipykernel's do_execute transforms the cell's code (``shell.transform_cell``) to decide how
    to run it, then IPython's run_cell transforms the same code again, with nothing run in
    between: the second call gets the first one's result (about 80 us of a rank's CPU per cell).
    Only that once: the shell's own method is back (and any later call computes afresh) as soon
    as it was reused or the cell ends."""

    def __init__(self, shell) -> None:  # type: ignore[no-untyped-def]
        self.shell = shell
        self.memo: tuple[str, str] | None = None
        if shell is not None and "transform_cell" not in vars(shell):
            shell.transform_cell = self
        else:
            self.shell = None

    def __call__(self, raw_cell: str) -> str:
        memo, self.memo = self.memo, None
        if memo is not None and memo[0] == raw_cell:
            self.close()
            return memo[1]
        cell = type(self.shell).transform_cell(self.shell, raw_cell)
        self.memo = (raw_cell, cell)
        return cell

    def close(self) -> None:
        if self.shell is not None:
            if vars(self.shell).get("transform_cell") is self:
                del self.shell.transform_cell
            self.shell = None

_memoize_accepts_parameters(ipkernel)
_memoize_cell_hash(compiler)
cell_files.share_cell_files()
