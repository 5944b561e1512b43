"""The head start: a ``%%distributed`` cell goes to the ranks as soon as the notebook kernel gets it.

Why: between ipykernel receiving an execute_request and IPython calling the ``%%distributed``
magic, the notebook kernel reads the message, publishes its busy status and the cell's input,
stores its history, transforms and compiles the cell and dispatches the magic, 1.5-1.9 ms on the
16-core host (docs/PERFORMANCE.md), during which the ranks sat idle; their own round trip, over a
millisecond, came after it. Sending the cell as ipykernel's dispatch receives it lets the two
overlap: by the time the magic runs, the ranks are running the cell or done with it, and the magic
only waits for and shows what they did (:meth:`clorch_repl.session.session.Session.finish`).

What makes it safe:

- The text sent is the text the magic is handed: the head start reads the cell with the shell's
  own input transformers, the way IPython reads a cell magic (:func:`split_cell`, pure, held to
  IPython's full transform by its tests), and the magic checks that what it was called with is
  what was sent (:meth:`HeadStart.claim`). A cell that is anything else, a shell with AST or
  post transformers (which could change the magic's call), an aliased or replaced magic, or
  ``--profile`` (its profiler starts before the cell) takes the ordinary path.
- The line is read by the magic's own reader (:func:`clorch_repl.magics.cell_options.cell_options`)
  and the cell is refused by the session's own rules (:meth:`Session.begin`): whatever would make
  the magic refuse the cell makes the head start not send it, and the magic then says why, in the cell.
- Only a signed execute_request is read (:func:`clorch_repl.wire.framing.peek_execute`: the
  session's key, its replay history, as ipykernel checks them), and none while ipykernel aborts
  queued requests after an error.
- Nothing is read from the ranks before the magic claims the cell (:meth:`HeadStart.claim`), so
  their output lands in the cell, after its input, in order; a cell the magic never claims
  (IPython failed before reaching it) is interrupted on the ranks and its output shown when
  ipykernel's dispatch returns, so no rank is left running a cell nobody waits for.
- ``CLORCH_HEAD_START=0`` in the notebook's environment (``%env CLORCH_HEAD_START=0``) turns it off.

The seams of ipykernel touched are its ``dispatch_shell`` (an instance attribute over the
class's method, as ipykernel 6 and 7 look it up; subshells' and concurrent comm dispatches pass
straight through) and its execute_request handler (``kernel.shell_handlers``), wrapped once each
and restored by ``%unload_ext``.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from IPython.core.error import UsageError

from ..common import env_vars, workdir
from ..errors import ClorchError, DistributedCellError
from ..notebook.front_end import NotebookStdin
from ..wire.framing import peek_execute
from .cell_options import cell_options

if TYPE_CHECKING:
    from ..session.relay import StartedCell
    from .core import ClorchMagics

logger = logging.getLogger(__name__)

__all__ = ["ENV", "HeadStart", "split_cell", "wanted"]

#: the notebook environment's switch: "0" turns the head start off, "1" (the default) on
ENV = env_vars.HEAD_START.name
MAGIC = "distributed"
#: what the content frame of a message must hold to be read at all (every other message passes)
MARKER = b"%%" + MAGIC.encode()

Dispatch = Callable[..., Awaitable[Any]]

#: the wrong values of :data:`ENV` already said in the log (it is read every cell: said once each)
_warned: set[str] = set()


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the head start is on: ``CLORCH_HEAD_START`` unset, ``1`` or empty; ``0`` is off.
    Anything else is a mistake, said once in the notebook kernel's log, and leaves it on."""
    value = (env_vars.HEAD_START.get(environ) or "").strip()
    if value not in ("", "0", "1") and value not in _warned:
        _warned.add(value)
        logger.warning("clorch_repl: %s=%r is neither 0 nor 1; the head start stays on", ENV, value)
    return value != "0"


def split_cell(manager: Any, code: str) -> tuple[str, str] | None:
    """``(line, body)``, the arguments IPython will call the ``%%distributed`` magic with for
    ``code``, read the way IPython's input transformer ``manager`` reads a cell magic; None for
    any other cell, and for any cell whose reading this cannot be sure of.

    IPython's ``transform_cell`` takes about 0.1 ms (it tokenizes the cell, then prefilters
    it), spent again when IPython runs the cell; a cell magic needs only its first steps: the
    cleanup transforms (the manager's own, so a user's added ones count), then the cell-magic
    rule (``IPython.core.inputtransformer2.cell_magic``: the first line's name and the rest of
    the line, the remaining lines as the body). A manager with other line transforms, and a
    shell with post transforms (``input_transformers_post``, which the caller checks), are not
    read here. ``tests/unit/test_head_start_reading.py`` holds this to IPython's full transform."""
    if len(manager.line_transforms) != 1 or getattr(manager.line_transforms[0], "__name__", "") != "cell_magic":
        return None
    cell = code if code.endswith("\n") else code + "\n"
    lines = cell.splitlines(keepends=True)
    for transform in manager.cleanup_transforms:
        lines = transform(lines)
    if not lines or not lines[0].startswith("%%"):
        return None
    name, _, line = lines[0][2:].rstrip().partition(" ")
    body = "".join(lines[1:])
    if name != MAGIC or not body:
        return None  # another magic, %%distributed? (help), or no body (IPython says so itself)
    return line, body


@dataclass
class _Pending:
    """A cell the head start sent to the ranks, waiting for the magic to claim it."""

    msg_id: str
    line: str
    body: str
    number: int
    #: the relay's handle (marked interrupted when a Ctrl-C came while it was being sent)
    started: StartedCell


class HeadStart:
    """Sends ``%%distributed`` cells from ipykernel's shell dispatch (see the module docstring)."""

    def __init__(self, magics: ClorchMagics) -> None:
        self._magics = magics
        self._kernel: Any = None
        self._original: Dispatch | None = None
        self._handler: Dispatch | None = None
        self._original_execute: Callable[..., Any] | None = None
        self._execute_handler: Callable[..., Any] | None = None
        self._pending: _Pending | None = None
        #: installed and not uninstalled since (the originals are kept: a wrapper still held passes through)
        self._active = False

    # ---------------------------------------------------------------------------- the seam
    def install(self, kernel: Any) -> bool:
        """Wrap ``kernel``'s ``dispatch_shell`` and its execute_request handler (the notebook's
        ipykernel; None or another kind of kernel: nothing to wrap, every cell takes the ordinary
        path). Whether it did.

        Why the dispatch and not only the handler: between the two, ipykernel reads the message
        (jupyter_client's deserialize, dates through dateutil), makes it the current request and
        publishes the busy status, 0.4 ms on the 16-core host (docs/PERFORMANCE.md), which the
        ranks can spend running the cell instead. The handler's wrapper only ends a cell the
        magic never claimed, before ipykernel says the request is over (its idle status, after
        which a front end shows nothing more of the cell)."""
        dispatch = getattr(kernel, "dispatch_shell", None)
        handlers = getattr(kernel, "shell_handlers", None)
        if (self._active or not callable(dispatch) or getattr(kernel, "session", None) is None
                or not isinstance(handlers, dict) or "execute_request" not in handlers):
            return False
        if not callable(getattr(kernel, "shell_main", None)):
            # ipykernel 6 binds dispatch_shell once, when the kernel starts: a wrapper put on the
            # instance later is never called, and one bound at start outlives an uninstall.
            logger.info("clorch_repl: this ipykernel binds its shell dispatch at start; no head start")
            return False
        self._kernel, self._original, self._original_execute = kernel, dispatch, handlers["execute_request"]
        self._handler, self._execute_handler = self._dispatch_shell, self._execute_request
        kernel.dispatch_shell = self._handler
        handlers["execute_request"] = self._execute_handler
        self._active = True
        return True

    def uninstall(self) -> None:
        """Give ipykernel its own dispatch and handler back (where nothing replaced ours since)."""
        if not self._active:
            return
        self._active = False  # the wrappers pass straight through from now on, wherever they are still held
        kernel = self._kernel
        if getattr(kernel, "dispatch_shell", None) is self._handler:
            del kernel.dispatch_shell  # the class's own method again
        if kernel.shell_handlers.get("execute_request") is self._execute_handler:
            kernel.shell_handlers["execute_request"] = self._original_execute

    async def _dispatch_shell(self, msg: Any, *args: Any, **kwargs: Any) -> Any:
        assert self._original is not None
        if not self._active or args or kwargs.get("subshell_id") is not None or kwargs.get("concurrent"):
            return await self._original(msg, *args, **kwargs)  # a subshell's or a comm beside a cell
        self._pending = None
        try:
            parent = self._peek(msg)
            self._pending = None if parent is None else self._begin(parent)
        except KeyboardInterrupt:  # before anything was sent (one during the send marks the relay's handle)
            logger.info("clorch_repl: a Ctrl-C before the cell was sent; it runs the ordinary way")
        except Exception:  # noqa: BLE001 - the cell must still run: ipykernel's own path will say what failed
            logger.warning("clorch_repl: sending the cell ahead of IPython failed; it runs the ordinary way",
                           exc_info=True)
        try:
            return await self._original(msg, *args, **kwargs)
        finally:
            self._end_unclaimed()  # ipykernel never ran the handler (nothing else leaves one)

    async def _execute_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> Any:
        assert self._original_execute is not None
        try:
            result = self._original_execute(stream, ident, parent)
            if inspect.isawaitable(result):
                result = await result
            return result
        finally:
            self._end_unclaimed()  # IPython failed the cell before the magic: shown in the cell

    def _end_unclaimed(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self._abandon(pending)

    def _peek(self, msg: Any) -> dict[str, Any] | None:
        """The execute_request in ``msg`` if it may be a ``%%distributed`` cell that ipykernel
        will run (not while it aborts queued requests after an error)."""
        kernel = self._kernel
        if getattr(kernel, "_aborting", False) or self._magics.session is None:
            return None
        return peek_execute(kernel.session, msg, MARKER)

    # ----------------------------------------------------------------------------- the cell
    def _begin(self, parent: dict[str, Any]) -> _Pending | None:
        """Send the cell of ``parent`` (an execute_request's header and content) to the ranks if
        it is a ``%%distributed`` cell the magic would run; None, having sent nothing, otherwise."""
        content = parent.get("content") or {}
        code = content.get("code")
        if not isinstance(code, str) or not code.lstrip().startswith("%%" + MAGIC):
            return None  # every other cell pays this test only
        magics, shell = self._magics, self._magics.shell
        session = magics.session
        if (session is None or not session.running or not wanted(os.environ) or shell.ast_transformers
                or shell.input_transformers_post):
            return None
        if getattr(shell.magics_manager.magics["cell"].get(MAGIC), "__self__", None) is not magics:
            return None  # aliased, replaced or unregistered: the ordinary path decides
        try:
            call = split_cell(shell.input_transformer_manager, code)
            if call is None:
                return None
            line, body = call
            if "$" in line or "{" in line:
                return None  # IPython expands variables in a magic's line ($x, {x}) before the magic reads it
            options = cell_options(magics.distributed, line, quiet_help=True)
            if options is None or options.profile is not None:
                return None
            if options.gather is not None and workdir.torch_import_refused():
                return None  # the magic refuses it before any rank runs it (its gather would import torch)
            number = int(shell.execution_count)  # what the magic's cell number will read
            started = session.begin(body, options.rank_list, options.timeout_s, hang_notice_s=options.hang_notice_s,
                                    stdin_ranks=options.stdin_rank_list, cell_number=number,
                                    stdin=NotebookStdin.current(bool(content.get("allow_stdin", False))))
        except (UsageError, ClorchError):
            return None  # refused: the magic refuses it again, in the cell, with the same words
        return _Pending(str(parent.get("header", {}).get("msg_id", "")), line, body, number, started)

    def claim(self, line: str, body: str, number: int) -> StartedCell | None:
        """The relay's handle of the cell the head start sent for this magic call (marked
        interrupted when a Ctrl-C came during its send); None when none was sent (the magic sends
        it itself)."""
        pending = self._pending
        if pending is None or not self._for_current_request(pending):
            return None  # another request's magic call (a subshell's, a nested run_cell): not this cell
        self._pending = None
        if (pending.line, pending.body, pending.number) != (line, body, number):
            # Cannot happen by construction (the same transform, the same reader); if it does,
            # the ranks run what was sent, the cell shows it, and the log says so.
            logger.error("clorch_repl: the head start sent %r (cell %d) but the magic was called with %r (cell %d); "
                         "showing the ranks' run of what was sent. Set %s=0 to turn the head start off.",
                         (pending.line, pending.body), pending.number, (line, body), number, ENV)
        return pending.started

    def _for_current_request(self, pending: _Pending) -> bool:
        """Whether the magic call runs in the request the head start sent ``pending`` for."""
        parent = self._kernel.get_parent("shell") if self._kernel is not None else None
        return (parent or {}).get("header", {}).get("msg_id") == pending.msg_id

    def _abandon(self, pending: _Pending) -> None:
        """The magic never claimed the cell (the notebook's cell was interrupted, or failed, before
        IPython reached it): interrupt it on the ranks, show what they did, free them."""
        from ..notebook.display import NotebookDisplay

        session = self._magics.session
        if session is None or not session.running:
            return
        request = pending.started.request
        outcome = session.finish(pending.started, NotebookDisplay(request.ranks, hosts=session.hosts()),
                                 interrupted=True)
        print(f"clorch: the notebook's cell ended before %%distributed ran, so its ranks were interrupted "
              f"({DistributedCellError(outcome).summary() if not outcome.ok else 'they had finished'})")
