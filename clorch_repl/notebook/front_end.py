"""The notebook's stdin hook: a rank's prompt asked of the notebook's own front end.

The notebook kernel asks its front end for a line with an ``input_request`` on its stdin socket,
with the parent and routing identity of the cell being run (what ipykernel's ``raw_input``
sends), and reads the ``input_reply`` on that socket. Why not call the notebook kernel's
``input()``: it blocks until the user answers, and the relay must keep streaming the other
ranks' output meanwhile (see :mod:`clorch_repl.session.stdin`). So this hook sends the same
request and lets the relay poll the reply on the same socket. Each prompt starts with the rank's
label (``[rank 1] (Pdb) ``).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import zmq

from ..session.hooks import NoStdin, StdinHook
from .display import label

logger = logging.getLogger(__name__)


class NotebookStdin(StdinHook):
    """The notebook kernel's way to ask its front end for a line, without blocking (see module)."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.socket: zmq.Socket = kernel.stdin_socket
        kernel._parent_ident["shell"]  # noqa: B018 - there in ipykernel 6 and 7 (a view in 7); read in _cell

    def _cell(self) -> tuple[Any, dict[str, Any]]:
        """The routing identity and parent of the notebook's cell running now, read when a prompt
        is opened, not when the cell was sent: a cell can be sent to the ranks before ipykernel
        has made it the current request (clorch_repl.magics.head_start)."""
        return self.kernel._parent_ident["shell"], self.kernel.get_parent("shell")

    @staticmethod
    def current(allow_stdin: bool | None = None) -> StdinHook | NoStdin:
        """The front end of the cell now running in the notebook kernel, or why there is none.
        ``allow_stdin``: what the cell's execute_request allowed, where ipykernel has not recorded
        it yet (the cell is being sent from its shell dispatch, clorch_repl.magics.head_start);
        None reads ipykernel's record of the cell running now."""
        from IPython.core.getipython import get_ipython

        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None or getattr(kernel, "stdin_socket", None) is None:
            return NoStdin("the notebook runs in no Jupyter kernel, so there is no front end to ask")
        if not (getattr(kernel, "_allow_stdin", False) if allow_stdin is None else allow_stdin):
            return NoStdin("the notebook's front end sent this cell with allow_stdin=False (it does not "
                           "answer input requests: e.g. nbclient, or jupyter execute)")
        try:
            return NotebookStdin(kernel)
        except (AttributeError, LookupError) as exc:  # an ipykernel whose internals differ
            logger.warning("cannot ask the notebook's front end for input: %s", exc)
            return NoStdin(f"this ipykernel's stdin cannot be used by clorch_repl ({exc})")

    def open(self, rank: int, prompt: str, password: bool) -> None:
        """Send an input_request to the front end, as ipykernel's ``_input_request`` does."""
        for stream in (sys.stdout, sys.stderr):  # what the cell showed comes before the prompt
            if stream is not None:
                stream.flush()
        self.cancel()
        ident, parent = self._cell()
        self.kernel.session.send(self.socket, "input_request", {"prompt": label(rank) + prompt, "password": password},
                                 parent, ident=ident)

    def cancel(self) -> None:
        """Drop stale replies (to a prompt that was closed: the rank was interrupted or died)."""
        while True:
            try:
                self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def poll(self) -> str | None:
        """The answer, if one has arrived; None otherwise."""
        try:
            _, msg = self.kernel.session.recv(self.socket, mode=zmq.NOBLOCK)
        except (ValueError, KeyError) as exc:  # a malformed or badly signed message: ignored, as ipykernel does
            logger.warning("ignored an invalid message on the notebook kernel's stdin: %s", exc)
            return None
        if msg is None:
            return None
        if msg.get("msg_type") != "input_reply":
            logger.warning("ignored a %s on the notebook kernel's stdin", msg.get("msg_type"))
            return None
        return str((msg.get("content") or {}).get("value", ""))
