"""Which of many ZeroMQ sockets have a message, at a cost that grows with the busy ones, not all.

Why not ``zmq.Poller``: ``zmq_poll`` asks every registered socket for its events on every call,
and the relay registers three per rank (iopub, shell, stdin). At 64 ranks that is 192 sockets,
about 60 us a call on the 2-core box, five or more calls a cell: 0.76 ms of the notebook's CPU in
an empty 64-rank cell (docs/PERFORMANCE.md, issue 39), on the one thread every rank's message
passes through.

How: each ZeroMQ socket has a file descriptor (``zmq.FD``) that becomes readable when something
happened to the socket; it is not a "message waiting" flag. Reading the socket's ``zmq.EVENTS``
processes what happened and resets it, and so do ``send`` and ``recv`` on the socket. So a socket
is *suspect* (it may hold a message that no descriptor will announce again) from the moment its
descriptor wakes ``epoll``, something is sent on it (:meth:`touched`) or it is registered, until
its ``zmq.EVENTS`` says it holds nothing; :meth:`poll` asks only suspects for their events. A
socket that reported a message stays suspect until a later look finds it empty, so one read but
not drained (the relay reads a bounded batch per pass) is found again.

A reader that drains a socket (reads until its ``zmq.EVENTS`` says empty, as the relay's read
loop does) says so (:meth:`drained`), so the socket is not asked again until its descriptor
wakes: an empty cell then asks a rank's sockets three times (its shell after the request's send,
at the reply's wake-up, and empty after the reply), where ``zmq_poll`` asked all three of them on
every call, five or more a cell. Each ask is two system calls inside libzmq (``getpid`` and a
``poll`` of the socket's mailbox): what ``zmq_poll`` spent was those, not Python.

Safety net: a send on one of these sockets by code that does not call :meth:`touched` (another
thread's, a library's) can swallow a wake-up. Every :data:`SWEEP_S` of waiting, every socket that
anything may send on is asked anyway, as ``zmq_poll`` would: such a message is late by at most
that, never lost. A socket nothing sends on, whose every reader either drains it or says it
left it holding messages (:meth:`touched`), is registered with ``swept=False`` and left out: a
rank's iopub (a SUB socket), read by the relay's loop and by the connect's wait, which hands back
a survivor's socket it leaves unread (session/channels.py). At 64 ranks the sweep asked 192
sockets about ten times a second, 9 % of the notebook's CPU in an empty cell (issue 39's
profile), and a third of them could not have lost a wake-up.

A first version (2b03a82, reverted) kept every socket that had held a message suspect for one
more look, swept every 50 ms and asked through pyzmq's enums (a Python call per ``&``): at 64
ranks it cost the notebook as much as ``zmq_poll``.
"""

from __future__ import annotations

import logging
import select
import time
from typing import Any

import zmq

logger = logging.getLogger(__name__)

#: The longest a message can go unnoticed when a send elsewhere swallowed its socket's wake-up
#: (see the module's docstring): every socket is asked at least this often while waiting.
SWEEP_S = 0.1
#: How long after a send of the relay's its socket waits to be asked, unless its descriptor
#: wakes first (see :meth:`ReadySockets.sent`)
SENT_CHECK_S = 0.002
#: pyzmq's constants are enums (a Python call per ``&``); their plain values
_POLLIN, _FD = int(zmq.POLLIN), int(zmq.FD)


class ReadySockets:
    """``register`` sockets, ``poll`` for the ones with a message (``zmq.POLLIN``), ``touched``
    after a send on one. Linux (``epoll``); one thread polls (the relay's)."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._by_fd: dict[int, Any] = {}
        #: each socket's descriptor, and its place in registration order: ready sockets are
        #: returned in that order, as zmq_poll returns them (rank by rank, iopub before shell)
        self._fd: dict[Any, int] = {}
        self._order: dict[Any, int] = {}
        self._next = 0
        self._suspects: set[Any] = set()
        #: sockets sent on and not heard of since (see :meth:`sent`), and when they are asked
        self._sent: dict[Any, None] = {}
        self._sent_due = float("inf")
        #: the sockets the sweep asks (see the module's docstring)
        self._sweep: set[Any] = set()
        self._swept = time.monotonic()

    def __contains__(self, sock: Any) -> bool:
        return sock in self._fd

    def register(self, sock: Any, *, swept: bool = True) -> None:
        """Watch ``sock``; ``swept=False`` for a socket nothing but its reader ever uses (nothing
        can swallow its wake-up: the sweep leaves it out, see the module's docstring)."""
        fd = sock.getsockopt(_FD)
        self._epoll.register(fd, select.EPOLLIN)
        self._by_fd[fd], self._fd[sock], self._order[sock] = sock, fd, self._next
        self._next += 1
        self._suspects.add(sock)  # it may hold messages already
        if swept:
            self._sweep.add(sock)

    def unregister(self, sock: Any) -> None:
        """Forget ``sock`` (KeyError if it was not registered); before it is closed."""
        fd = self._fd.pop(sock)
        del self._by_fd[fd], self._order[sock]
        self._suspects.discard(sock)
        self._sent.pop(sock, None)
        self._sweep.discard(sock)
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):  # closed already
            pass

    def touched(self, sock: Any) -> None:
        """Say that something was sent on ``sock``: the send may have taken its wake-up."""
        self._suspects.add(sock)

    def sent(self, sock: Any) -> None:
        """Say that the relay sent on ``sock``: as :meth:`touched`, but the socket is asked only
        once :data:`SENT_CHECK_S` has passed with no word of it (its descriptor waking). Why: a
        cell sent to every rank made every rank's shell socket a suspect, asked at the next poll
        (64 asks at 64 ranks, each two system calls inside libzmq, an empty cell's largest cost
        of the relay's own after the replies' reading: ``benchmarks/relay_floor.py``), and none
        ever held anything: a rank's reply takes longer than the sends. A send takes a wake-up
        only when a message was there already (a reply to an earlier request, which the relay
        reads before a cell); that message is found :data:`SENT_CHECK_S` later, not at once."""
        if not self._sent:
            self._sent_due = time.monotonic() + SENT_CHECK_S
        self._sent[sock] = None

    def drained(self, sock: Any) -> None:
        """Say that ``sock``'s ``zmq.EVENTS`` was just read and said it holds nothing: its
        descriptor announces what comes next, so it is not asked again until then."""
        self._suspects.discard(sock)
        self._sent.pop(sock, None)

    def poll(self, timeout_s: float) -> list[Any]:
        """The registered sockets holding a message, waiting up to ``timeout_s`` for one."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        sent = self._sent
        while True:
            now = time.monotonic()
            wait = 0.0 if self._suspects else max(0.0, min(deadline, self._swept + SWEEP_S, self._sent_due) - now)
            for fd, _ in self._epoll.poll(wait):
                sock = self._by_fd.get(fd)
                if sock is not None:
                    self._suspects.add(sock)
                    if sent:
                        sent.pop(sock, None)  # heard of: asked now, as a woken socket is
            now = time.monotonic()
            if now >= self._sent_due:
                self._suspects.update(sent)
                sent.clear()
            if not sent:
                self._sent_due = float("inf")
            if now >= self._swept + SWEEP_S:
                self._suspects.update(self._sweep)
                self._swept = now
            # one zmq_poll of the suspects (each one's EVENTS looked up in C): pyzmq's getsockopt
            # builds an enum of the option on every call, 1.5 us a socket against 0.7 here at 64
            suspects = self._suspects
            ready = [sock for sock, _ in zmq.zmq_poll([(sock, _POLLIN) for sock in suspects], 0)] if suspects else []
            # asked and empty: their descriptors announce what comes next; those holding a message
            # stay suspects until a look finds them empty (the reader's, see drained)
            self._suspects = set(ready)
            if ready or now >= deadline:
                return sorted(ready, key=self._order.__getitem__)

    def close(self) -> None:
        self._sent.clear()
        self._by_fd.clear()
        self._fd.clear()
        self._order.clear()
        self._suspects.clear()
        self._sweep.clear()
        self._epoll.close()
