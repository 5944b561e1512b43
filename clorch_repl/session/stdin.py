"""Prompts of ranks, answered in the notebook: a rank's ``input()``, ``getpass``, ``breakpoint()``.

A rank's kernel asks for a line with an ``input_request`` on its stdin channel, exactly as a
kernel asks its front end. The relay reads those requests and hands them to a :class:`StdinBroker`
(one per cell), which asks the notebook's own front end through the notebook kernel (ipykernel's
session, stdin socket, and the parent and routing identity of the cell being run: what
ipykernel's ``raw_input`` sends) and returns the answer on that rank's stdin channel.

Why not call the notebook kernel's ``input()``: it blocks until the user answers, and while a rank
waits at a prompt the relay must keep streaming the other ranks' output, notice a rank dying, and
keep the cell's time limit. So the broker sends the same ``input_request`` and polls the reply on
the same socket, inside the relay's one poll loop. Kernel > Interrupt still lands in that loop as
KeyboardInterrupt, and the relay interrupts the ranks as for any cell (the rank's ``input()``
raises KeyboardInterrupt).

One prompt is open at a time. Requests that arrive together (within :data:`GATHER_S`) are served
in rank order; each prompt starts with the rank's label (``[rank 1] (Pdb) ``).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import zmq

from .display import label

logger = logging.getLogger(__name__)

#: After a rank's input_request arrives, how long the broker waits before opening the prompt:
#: requests of other ranks arriving meanwhile are served in rank order, and the rank's output
#: printed before it asked (a pdb location line) has reached the display.
GATHER_S = 0.15


class FrontEnd:
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
    def current(allow_stdin: bool | None = None) -> tuple[FrontEnd | None, str]:
        """The front end of the cell now running in the notebook kernel, or None and why not.
        ``allow_stdin``: what the cell's execute_request allowed, where ipykernel has not recorded
        it yet (the cell is being sent from its shell dispatch, clorch_repl.magics.head_start);
        None reads ipykernel's record of the cell running now."""
        try:
            from IPython.core.getipython import get_ipython
        except ImportError:  # pragma: no cover - IPython is a dependency
            return None, "IPython is not available"
        shell = get_ipython()
        kernel = getattr(shell, "kernel", None)
        if kernel is None or getattr(kernel, "stdin_socket", None) is None:
            return None, "the notebook runs in no Jupyter kernel, so there is no front end to ask"
        if not (getattr(kernel, "_allow_stdin", False) if allow_stdin is None else allow_stdin):
            return None, ("the notebook's front end sent this cell with allow_stdin=False (it does not "
                          "answer input requests: e.g. nbclient, or jupyter execute)")
        try:
            return FrontEnd(kernel), ""
        except (AttributeError, LookupError) as exc:  # an ipykernel whose internals differ
            logger.warning("cannot ask the notebook's front end for input: %s", exc)
            return None, f"this ipykernel's stdin cannot be used by clorch_repl ({exc})"

    def ask(self, prompt: str, password: bool) -> None:
        """Send an input_request to the front end, as ipykernel's ``_input_request`` does."""
        for stream in (sys.stdout, sys.stderr):  # what the cell showed comes before the prompt
            if stream is not None:
                stream.flush()
        self.purge()
        ident, parent = self._cell()
        self.kernel.session.send(self.socket, "input_request", {"prompt": prompt, "password": password},
                                 parent, ident=ident)

    def purge(self) -> None:
        """Drop stale replies (to a prompt that was closed: the rank was interrupted or died)."""
        while True:
            try:
                self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return

    def reply(self) -> str | None:
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


@dataclass
class _Ask:
    prompt: str
    password: bool
    at: float


class StdinBroker:
    """One cell's prompts (see the module docstring); driven by the relay's poll loop."""

    def __init__(self, front: FrontEnd | None, answer: Callable[[int, str], None]) -> None:
        self.front = front
        self._answer = answer
        self._asks: dict[int, _Ask] = {}
        #: the rank whose prompt is open at the front end
        self.open: int | None = None

    @property
    def waiting(self) -> set[int]:
        """Ranks waiting for a line (the open prompt's and those queued)."""
        return set(self._asks)

    @property
    def prompts(self) -> dict[int, str]:
        """Per waiting rank, the prompt it waits at (for the hang diagnosis: held, not hung)."""
        return {rank: ask.prompt for rank, ask in self._asks.items()}

    def request(self, rank: int, msg: dict[str, Any]) -> None:
        """A rank's input_request."""
        content = msg.get("content") or {}
        self._asks[rank] = _Ask(str(content.get("prompt", "")), bool(content.get("password")), time.monotonic())
        if self.front is None:
            # The rank was sent allow_stdin=False, so its kernel raises instead of asking; a
            # request anyway (a thread of an earlier cell) gets end-of-file rather than a hang.
            logger.warning("rank %d asked for input with no front end to ask; answered with end-of-file", rank)
            self._send(rank, "\x04")

    def next_step(self) -> float | None:
        """When :meth:`step` must run next (a gathered request's prompt opens), if at all."""
        if self.open is not None or not self._asks:
            return None
        return min(a.at for a in self._asks.values()) + GATHER_S

    def step(self, active: set[int], before_prompt: Callable[[], None]) -> bool:
        """Drop requests of ranks no longer running (``active``); take the front end's answer;
        open the next prompt when it is due. Returns True when an answer went to a rank."""
        for rank in [r for r in self._asks if r not in active]:
            del self._asks[rank]
            if self.open == rank:
                self.open = None
        answered = False
        if self.front is None:
            return False
        if self.open is None:
            self.front.purge()  # a late answer to a prompt that was closed must not spin the poll
        else:
            value = self.front.reply()
            if value is not None:
                rank, self.open = self.open, None
                self._send(rank, value)
                answered = True
        due = self.next_step()
        if due is not None and time.monotonic() >= due:
            rank = min(self._asks)
            ask = self._asks[rank]
            before_prompt()
            self.front.ask(label(rank) + ask.prompt, ask.password)
            self.open = rank
        return answered

    def _send(self, rank: int, value: str) -> None:
        self._asks.pop(rank, None)
        self._answer(rank, value)
