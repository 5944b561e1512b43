"""The head start: a ``%%distributed`` cell goes to the ranks as soon as the notebook kernel gets it.

Why: between ipykernel receiving an execute_request and IPython calling the ``%%distributed``
magic, the notebook kernel publishes the cell's input, stores its history, transforms and compiles
it and dispatches the magic, about a millisecond on the machines measured (docs/PERFORMANCE.md),
during which the ranks sat idle. Their own round trip, a millisecond or more, came after it.
Sending the cell from ipykernel's shell handler instead lets the two overlap: by the time the
magic runs, the ranks are running the cell or done with it, and the magic only waits for and
shows what they did (:meth:`clorch_repl.session.session.Session.finish`).

What makes it safe:

- The text sent is the text the magic is handed: the handler reads the cell with the shell's
  own input transformers, the way IPython reads a cell magic (:func:`split_cell`, pure, held to
  IPython's full transform by its tests), and the magic checks that what it was called with is
  what was sent (:meth:`HeadStart.claim`). A cell that is anything else, a shell with AST or
  post transformers (which could change the magic's call), an aliased or replaced magic, or
  ``--profile`` (its profiler starts before the cell) takes the ordinary path.
- The line is read by the magic's own reader (:func:`clorch_repl.magics.cell_options.cell_options`)
  and the cell is refused by the session's own rules (:meth:`Session.begin`): whatever would make
  the magic refuse the cell makes the handler not send it, and the magic then says why, in the cell.
- Nothing is read from the ranks before the magic claims the cell (:meth:`HeadStart.claim`), so
  their output lands in the cell, after its input, in order; a cell the magic never claims (a
  Ctrl-C before IPython reached it) is interrupted on the ranks and its output shown when
  ipykernel's handler returns, so no rank is left running a cell nobody waits for.
- ``CLORCH_HEAD_START=0`` in the notebook's environment (``%env CLORCH_HEAD_START=0``) turns it off.

The one seam of ipykernel touched is its table of shell handlers (``kernel.shell_handlers``),
wrapped for ``execute_request`` once and restored by ``%unload_ext``.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from IPython.core.error import UsageError

from ..errors import ClorchError, DistributedCellError
from .cell_options import cell_options

if TYPE_CHECKING:
    from ..session.relay import StartedCell
    from .core import ClorchMagics

logger = logging.getLogger(__name__)

__all__ = ["ENV", "HeadStart", "split_cell", "wanted"]

#: the notebook environment's switch: "0" turns the head start off, "1" (the default) on
ENV = "CLORCH_HEAD_START"
MAGIC = "distributed"

Handler = Callable[[Any, Any, dict[str, Any]], Awaitable[Any] | Any]


def wanted(environ: Mapping[str, str]) -> bool:
    """Whether the head start is on: ``CLORCH_HEAD_START`` unset, ``1`` or empty; ``0`` is off.
    Anything else is a mistake, said in the notebook kernel's log, and leaves it on."""
    value = environ.get(ENV, "1").strip()
    if value not in ("", "0", "1"):
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
    """A cell the handler sent to the ranks, waiting for the magic to claim it."""

    msg_id: str
    line: str
    body: str
    number: int
    started: StartedCell
    #: Ctrl-C reached the notebook kernel while the cell was being sent: the cell ends interrupted
    interrupted: bool = False


class HeadStart:
    """Sends ``%%distributed`` cells from ipykernel's shell handler (see the module docstring)."""

    def __init__(self, magics: ClorchMagics) -> None:
        self._magics = magics
        self._kernel: Any = None
        self._original: Handler | None = None
        self._handler: Handler | None = None
        self._pending: _Pending | None = None

    # ---------------------------------------------------------------------------- the seam
    def install(self, kernel: Any) -> bool:
        """Wrap ``kernel``'s execute_request handler (the notebook's ipykernel; None or another
        kind of kernel: nothing to wrap, every cell takes the ordinary path). Whether it did."""
        handlers = getattr(kernel, "shell_handlers", None)
        if self._original is not None or not isinstance(handlers, dict) or "execute_request" not in handlers:
            return False
        self._kernel, self._original = kernel, handlers["execute_request"]
        self._handler = self._execute_request
        handlers["execute_request"] = self._handler
        return True

    def uninstall(self) -> None:
        """Give ipykernel its own handler back (if nothing replaced ours since)."""
        if self._original is None:
            return
        handlers = self._kernel.shell_handlers
        if handlers.get("execute_request") is self._handler:
            handlers["execute_request"] = self._original
        self._kernel = self._original = self._handler = None

    async def _execute_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> Any:
        assert self._original is not None
        try:
            self._pending = self._begin(parent)
        except KeyboardInterrupt:  # Ctrl-C in the moment the cell was sent: it ends interrupted
            self._pending = self._recovered(parent)
        except Exception:  # noqa: BLE001 - the cell must still run: ipykernel's own path will say what failed
            logger.warning("clorch_repl: sending the cell ahead of IPython failed; it runs the ordinary way",
                           exc_info=True)
            self._pending = self._recovered(parent)
        try:
            result = self._original(stream, ident, parent)
            if inspect.isawaitable(result):
                result = await result
            return result
        finally:
            pending, self._pending = self._pending, None
            if pending is not None:
                self._abandon(pending)

    # ----------------------------------------------------------------------------- the cell
    def _begin(self, parent: dict[str, Any]) -> _Pending | None:
        """Send the cell of ``parent`` (an execute_request) to the ranks if it is a
        ``%%distributed`` cell the magic would run; None, having sent nothing, otherwise."""
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
            options = cell_options(magics.distributed, line, quiet_help=True)
            if options is None or options.profile is not None:
                return None
            number = int(shell.execution_count)  # what the magic's cell number will read
            started = session.begin(body, options.rank_list, options.timeout_s, hang_notice_s=options.hang_notice_s,
                                    stdin_ranks=options.stdin_rank_list, cell_number=number,
                                    allow_stdin=bool(content.get("allow_stdin", False)))
        except (UsageError, ClorchError):
            return None  # refused: the magic refuses it again, in the cell, with the same words
        return _Pending(str(parent.get("header", {}).get("msg_id", "")), line, body, number, started)

    def _recovered(self, parent: dict[str, Any]) -> _Pending | None:
        """After a Ctrl-C (or a failure) inside :meth:`_begin`: the cell, if the relay had sent
        it, marked interrupted (a cell sent and then lost would keep its ranks busy with nobody
        reading them); None when nothing was sent."""
        session = self._magics.session
        relay = None if session is None else session.relay
        started = None if relay is None else relay.unfinished
        if started is None:
            return None  # nothing was sent: the cell runs as if the Ctrl-C had come before it
        code = started.request.code
        return _Pending(str(parent.get("header", {}).get("msg_id", "")), "", code,
                        started.request.cell_number or 0, started, interrupted=True)

    def claim(self, line: str, body: str, number: int) -> tuple[StartedCell, bool] | None:
        """The cell the handler sent for this magic call, and whether it was interrupted; None
        when none was sent (the magic sends it itself)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if not pending.interrupted and (pending.line, pending.body, pending.number) != (line, body, number):
            # Cannot happen by construction (the same transform, the same reader); if it does,
            # the ranks run what was sent, the cell shows it, and the log says so.
            logger.error("clorch_repl: the head start sent %r (cell %d) but the magic was called with %r (cell %d); "
                         "showing the ranks' run of what was sent. Set %s=0 to turn the head start off.",
                         (pending.line, pending.body), pending.number, (line, body), number, ENV)
        return pending.started, pending.interrupted

    def _abandon(self, pending: _Pending) -> None:
        """The magic never claimed the cell (the notebook's cell was interrupted, or failed, before
        IPython reached it): interrupt it on the ranks, show what they did, free them."""
        from ..session.display import NotebookDisplay

        session = self._magics.session
        if session is None or not session.running:
            return
        request = pending.started.request
        outcome = session.finish(pending.started, NotebookDisplay(request.ranks, hosts=session.hosts()),
                                 interrupted=True)
        print(f"clorch: the notebook's cell ended before %%distributed ran, so its ranks were interrupted "
              f"({DistributedCellError(outcome).summary() if not outcome.ok else 'they had finished'})")
