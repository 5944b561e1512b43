"""Prompts of ranks, answered through the cell's stdin hook: a rank's ``input()``, ``getpass``,
``breakpoint()``.

A rank's kernel asks for a line with an ``input_request`` on its stdin channel, exactly as a
kernel asks its front end. The relay reads those requests and hands them to a :class:`StdinBroker`
(one per cell), which asks the cell's :class:`~clorch_repl.session.hooks.StdinHook` (in the
notebook, :class:`clorch_repl.notebook.front_end.NotebookStdin` asks the notebook's own front end;
a script's hook answers itself) and returns the answer on that rank's stdin channel.

Why the hook is polled rather than called and waited for: while a rank waits at a prompt the relay
must keep streaming the other ranks' output, notice a rank dying, and keep the cell's time limit.
So the broker opens the prompt and polls for its answer inside the relay's one poll loop.
Kernel > Interrupt still lands in that loop as KeyboardInterrupt, and the relay interrupts the
ranks as for any cell (the rank's ``input()`` raises KeyboardInterrupt).

One prompt is open at a time. Requests that arrive together (within :data:`GATHER_S`) are served
in rank order.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from .hooks import END_OF_FILE, StdinHook

logger = logging.getLogger(__name__)

#: After a rank's input_request arrives, how long the broker waits before opening the prompt:
#: requests of other ranks arriving meanwhile are served in rank order, and the rank's output
#: printed before it asked (a pdb location line) has reached the display.
GATHER_S = 0.15


@dataclass
class _Ask:
    prompt: str
    password: bool
    at: float


class StdinBroker:
    """One cell's prompts (see the module docstring); driven by the relay's poll loop."""

    def __init__(self, front: StdinHook | None, answer: Callable[[int, str], None]) -> None:
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
            logger.warning("rank %d asked for input with no stdin hook to ask; answered with end-of-file", rank)
            self._send(rank, END_OF_FILE)

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
            self.front.cancel()  # a late answer to a prompt that was closed must not spin the poll
        else:
            value = self.front.poll()
            if value is not None:
                rank, self.open = self.open, None
                self._send(rank, value)
                answered = True
        due = self.next_step()
        if due is not None and time.monotonic() >= due:
            rank = min(self._asks)
            ask = self._asks[rank]
            before_prompt()
            self.front.open(rank, ask.prompt, ask.password)
            self.open = rank
        return answered

    def drop(self, ranks: tuple[int, ...] | list[int]) -> None:
        """``ranks`` were interrupted: their prompts, open or queued, are not asked any more (a
        rank that asks again after the interrupt, as pdb does, is asked anew), and an answer to
        the open one that comes late is dropped. Why at the interrupt and not when each rank
        ends: a blocking ``answer()`` holds the loop, so prompts pile up meanwhile, and each
        would be asked in turn before the interrupted ranks' ends are read."""
        for rank in ranks:
            self._asks.pop(rank, None)
        if self.open in ranks:
            self.open = None
            if self.front is not None:
                self.front.cancel()

    def _send(self, rank: int, value: str) -> None:
        self._asks.pop(rank, None)
        self._answer(rank, value)
