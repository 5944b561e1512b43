"""The ranks' kernel channels: the ZeroMQ sockets, readiness, and one signed, decoded read pass.

Why apart: sockets are the one thing of a cell that is neither pure nor policy. Everything that
decides what a message means (:mod:`.ledger`, :mod:`.cell_run`) gets decoded messages from here,
and the relay (:mod:`.relay`) never touches a socket itself. One thread (the caller's) polls
every rank's iopub, shell and stdin sockets (a rank's prompts, see :mod:`.stdin`) together
(:mod:`.ready_sockets`: epoll, asking only the sockets that may hold something), so output streams
live from all ranks at once with no threads to leak.
"""

from __future__ import annotations

import logging
import time
import warnings
from queue import Empty
from typing import Any, Callable, Iterator, Sequence

import zmq
from jupyter_client.blocking.client import BlockingKernelClient

from ..diagnosis.probe import Prober
from ..errors import ClorchError, SignatureError
from ..launchers.base import Launcher
from ..common.rank_sets import rank_words
from ..wire.framing import MessageDecoder, MessageEncoder
from .ready_sockets import ReadySockets

logger = logging.getLogger(__name__)

#: At most this many messages are read from one socket per pass, so that a rank flooding its
#: iopub neither starves the other sockets (its shell reply included) nor the cell's deadlines.
PUMP_BATCH = 256
KINDS = ("iopub", "shell", "stdin")
#: pyzmq's constants are enums, whose ``&`` and lookups cost a Python call each: in the read loop,
#: which runs for every message of every rank, their plain values
_EVENTS, _POLLIN, _NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
#: I/O threads of the one ZeroMQ context every rank's channels share (see :meth:`Channels.connect`);
#: ``benchmarks/relay_cost.py --io-threads`` measures others
IO_THREADS = 1


def _receive(sock: Any) -> list[bytes]:
    """One whole message from ``sock`` without waiting (zmq.Again when there is none): what
    ``recv_multipart(zmq.NOBLOCK)`` does, minus its ``getsockopt(RCVMORE)`` a frame (a frame
    knows whether more follow) and with plain constants (see :data:`_EVENTS`)."""
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


class Channels:
    """One jupyter_client channel set per rank, polled together."""

    def __init__(self, group: Launcher) -> None:
        self.group = group
        self.clients: dict[int, BlockingKernelClient] = {}
        self.ready = ReadySockets()
        self._owner: dict[Any, tuple[int, str]] = {}
        self._decoders: dict[int, MessageDecoder] = {}
        self._encoders: dict[int, MessageEncoder] = {}
        #: each rank's shell socket (a client's channel is reached through traitlets each time)
        self._shell: dict[int, Any] = {}
        self._rejected = 0
        self.prober = Prober()
        #: one ZeroMQ context (one I/O thread) for every rank's channels; see :meth:`connect`
        self._context = zmq.Context(io_threads=IO_THREADS)

    def connect(self, progress: Callable[[int, int], None], timeout_s: float = 120.0,
                ranks: Sequence[int] | None = None, late: tuple[float, Callable[[], None]] | None = None) -> None:
        """Open channels to every rank (or to ``ranks``: fresh processes that replaced them) and
        wait until each answers on shell and iopub; ``late``: (seconds, what to call once, if
        some rank has not answered by then)."""
        ready_kinds: dict[int, set[str]] = {}
        for proc in self.group.ranks:
            if ranks is not None and proc.rank not in ranks:
                continue
            self.drop(proc.rank)
            client = proc.client()
            # jupyter_client gives each client a context of its own, so the notebook had an I/O
            # thread per rank, asleep between cells: every request woke a different one (about
            # 25 us a rank on the 16-core host, 80-190 on the 2-core box, docs/PERFORMANCE.md).
            # One context: the first send of a cell wakes its I/O thread and the others find it
            # awake; the ranks' replies come back through it too.
            client.context = self._context
            client.start_channels(shell=True, iopub=True, stdin=True, hb=False, control=False)
            self.clients[proc.rank] = client
            self._decoders[proc.rank] = MessageDecoder(client.session)
            self._encoders[proc.rank] = MessageEncoder(client.session)
            self.prober.add(proc.rank, client, self._decoders[proc.rank])
            ready_kinds[proc.rank] = set()
            self._register(proc.rank, client)
        self._await_ready(ready_kinds, progress, timeout_s, notice=late)

    def _register(self, rank: int, client: Any) -> None:
        """Poll ``rank``'s iopub, shell and stdin sockets from now on. A rank's iopub (a SUB
        socket) is acted on only by the read loop and by :meth:`_await_ready`, which hands back
        the ones it leaves unread (see there): nothing else can swallow its wake-up, so the sweep
        leaves it out (see .ready_sockets)."""
        for kind in KINDS:
            sock = getattr(client, f"{kind}_channel").socket
            self.ready.register(sock, swept=kind != "iopub")
            self._owner[sock] = (rank, kind)
        self._shell[rank] = client.shell_channel.socket

    def drop(self, rank: int) -> None:
        """Close and forget ``rank``'s channels, if it has any (its process is being replaced)."""
        client = self.clients.pop(rank, None)
        if client is None:
            return
        for kind in KINDS:
            sock = getattr(client, f"{kind}_channel").socket
            self._owner.pop(sock, None)
            try:
                self.ready.unregister(sock)
            except KeyError:
                pass
        self.prober.remove(rank)
        self._shell.pop(rank, None)
        self._decoders.pop(rank, None)
        self._encoders.pop(rank, None)
        client.stop_channels()

    def _await_ready(self, seen: dict[int, set[str]], progress: Callable[[int, int], None],
                     timeout_s: float, notice: tuple[float, Callable[[], None]] | None) -> None:
        total = len(seen)
        began = time.monotonic()
        deadline = began + timeout_s
        late_at, on_late = notice if notice is not None else (float("inf"), None)
        late_at += began
        last_probe: dict[int, float] = {}
        reported = -1
        left: set[Any] = set()  # the survivors' sockets left holding messages for the relay
        try:
            while True:
                ready = [r for r, kinds in seen.items() if kinds >= {"iopub", "shell"}]
                if len(ready) != reported:
                    reported = len(ready)
                    progress(reported, total)
                if reported == total:
                    return
                for proc in self.group.ranks:
                    if not proc.alive:
                        raise ClorchError(
                            f"{proc.where} exited while starting ({proc.exit}); "
                            f"its log ends with:\n{self.group.log_tail(proc.rank, 20)}")
                now = time.monotonic()
                if on_late is not None and now > late_at:
                    on_late()
                    on_late = None
                if now > deadline:
                    late = sorted(set(seen) - set(ready))
                    tails = "\n".join(f"rank {r}'s log ends with:\n{self.group.log_tail(r, 10)}" for r in late)
                    raise ClorchError(f"{rank_words(late)} did not answer within {timeout_s:.0f} s of starting\n{tails}")
                for rank in seen:
                    if rank not in ready and now - last_probe.get(rank, 0.0) > 0.5:
                        # Repeated until iopub hears it too: the first may be published before our
                        # subscription is in place (ZeroMQ's slow joiner).
                        if rank in last_probe:  # (the first probe's answer missed: a slow joiner, or a busy rank)
                            logger.debug("rank %d: kernel_info again after %.3f s (seen %s)", rank, now - began,
                                         sorted(seen[rank]))
                        self.clients[rank].kernel_info()
                        self.ready.touched(self._shell[rank])
                        last_probe[rank] = now
                for sock in self.ready.poll(0.1):
                    rank, kind = self._owner[sock]
                    if rank not in seen:
                        # a surviving rank's output while fresh ones start (recovery.replace): left queued
                        # for the relay, not asked again during this wait, and handed back at its end
                        self.ready.drained(sock)
                        left.add(sock)
                        continue
                    channel = getattr(self.clients[rank], f"{kind}_channel")
                    while True:
                        try:
                            channel.get_msg(timeout=0)
                        except Empty:
                            break
                        if kind not in seen[rank]:
                            logger.debug("rank %d: %s answered %.3f s into the connect", rank, kind, time.monotonic() - began)
                        seen[rank].add(kind)
                    self.ready.drained(sock)  # get_msg asked until it found nothing
        finally:
            # A socket left holding a message signals no wake-up again until it is read, and a
            # survivor's iopub is not in the sweep: the read loop must ask these itself.
            for sock in left:
                if sock in self.ready:
                    self.ready.touched(sock)

    def new_prober(self) -> Prober:
        """A prober of every rank with sockets and signature checks of its own (``%clorch top``,
        whose questions must not take the relay's answers): ZeroMQ sockets and the replay check
        are per user."""
        prober = Prober()
        for rank, client in self.clients.items():
            prober.add(rank, client, MessageDecoder(client.session))
        return prober

    def send(self, rank: int, msg_type: str, metadata: bytes, content: bytes, date: str | None = None) -> str:
        """Sign and send a request on ``rank``'s shell (one frame, see wire.py) whose metadata and
        content are packed already (wire.pack: a cell's are packed once for all its ranks, and
        ``date``, its header's, taken once: framing.utc_date); its msg_id."""
        msg_id, frame = self._encoders[rank].frame(msg_type, b"{}", metadata, content, date)
        sock = self._shell[rank]
        sock.send(frame)  # one frame: not through send_multipart's loop
        self.ready.sent(sock)  # (the send may have taken the wake-up of a reply already there)
        return msg_id

    def touched(self, rank: int) -> None:
        """Something was sent on ``rank``'s shell by another module (a widget's message,
        clorch_repl.notebook.comms): its socket is asked at the next read (see .ready_sockets)."""
        sock = self._shell.get(rank)
        if sock is not None:
            self.ready.touched(sock)

    def answer(self, rank: int, value: str) -> None:
        """A line for ``rank``'s prompt (``"\\x04"``: end-of-file)."""
        client = self.clients[rank]
        client.input(value)
        self.ready.touched(client.stdin_channel.socket)

    def watch(self, socket: Any, on: bool) -> None:
        """Poll another socket too (the front end's stdin, while a prompt is open there)."""
        if (socket in self._owner) == on:
            return
        if on:
            self.ready.register(socket)
            self._owner[socket] = (-1, "front")
        else:
            self.ready.unregister(socket)
            del self._owner[socket]

    def read(self, timeout_s: float) -> Iterator[tuple[int, str, dict[str, Any]]]:
        """(rank, "iopub" | "shell" | "stdin", message) of what arrives within ``timeout_s``.

        One pass over the ready sockets, at most :data:`PUMP_BATCH` messages from each, so that
        the caller checks its deadlines and deaths between passes under a flood. A message
        whose signature fails is dropped (and said once)."""
        ready = self.ready
        for sock in ready.poll(timeout_s):
            rank, kind = self._owner[sock]
            if kind == "front":  # the front end's answer: read by the cell's stdin broker (stays suspect)
                continue
            decoder = self._decoders[rank]
            for i in range(PUMP_BATCH):
                # the poll said the first message is there; after it the socket is asked, not found
                # out by a zmq.Again (an exception a socket a pass costs ~10 us)
                if i and not sock.getsockopt(_EVENTS) & _POLLIN:
                    ready.drained(sock)
                    break
                try:
                    frames = _receive(sock)
                except zmq.Again:
                    break
                try:
                    msg = decoder.decode(frames)
                except SignatureError as exc:
                    self._rejected += 1
                    if self._rejected == 1:
                        warnings.warn(f"clorch_repl: dropped a message from rank {rank}: {exc}", RuntimeWarning,
                                      stacklevel=2)
                    continue
                yield rank, kind, msg

    def close(self) -> None:
        self.prober.close()
        for client in self.clients.values():
            for kind in KINDS:
                try:
                    self.ready.unregister(getattr(client, f"{kind}_channel").socket)
                except (KeyError, AttributeError):
                    pass
            client.stop_channels()
        self.clients.clear()
        self._shell.clear()
        self._owner.clear()
        self.ready.close()
        self._context.destroy(linger=100)  # as jupyter_client ends the context a client made itself
