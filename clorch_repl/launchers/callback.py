"""The notebook's end of remote ranks: one encrypted endpoint that ranks call back to.

Every remote rank runs ``python -m clorch_repl.rank`` (its nanny, :mod:`clorch_repl.host.nanny`) under
a launcher the cluster already runs. The nanny reads the session's **connect file** (named by
``CLORCH_CONNECT_FILE``; 0600, never on a command line) and connects out to this endpoint:

* **one address**: a ZeroMQ ROUTER bound to one address (``--listen``; by default the address of
  the interface that routes to the nodes, never 0.0.0.0) and one port;
* **encrypted and authenticated**: CurveZMQ. The connect file holds the endpoint's public key,
  so a nanny talks only to this notebook and nobody on the network reads the traffic; the nanny's
  every message carries the session's **token** (also only in the connect file), so only someone
  who could read that file can register a rank or send anything;
* **what crosses**: JSON objects, one per message (:func:`encode`), never pickles. A nanny
  registers (its rank, world, host, address), gets the rank's environment back, starts the
  rank's kernel on its own host (its channels bound to that host's address, encrypted with Curve
  keys made there) and reports the kernel's connection info; afterwards it reports the kernel's
  exit and answers requests (interrupt, stack dump, log tail, fresh kernel, stop).
* **liveness**: both sides send a heartbeat every :data:`HEARTBEAT_S`; a rank not heard from for
  :data:`LOST_AFTER_S` is reported lost (a cut link, a dead node), and a nanny that has not heard
  the notebook for ``--orphan-timeout`` ends its kernel and exits.

A background thread owns the socket (ZeroMQ sockets are not thread-safe); the notebook's main
thread talks to it through :meth:`CallbackServer.send` and :meth:`CallbackServer.request`, and
reads what it learnt (registrations, kernels, exits, last words) under a lock.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from ..common import env_vars
from ..common.atomic import remove_quietly
from ..errors import ClorchError
from . import liveness
from ..wire.connect import HEARTBEAT_S, ConnectInfo, route_address
from ..wire.nanny import FromNanny, ToNanny, decode, encode, mismatch

logger = logging.getLogger(__name__)

#: Where connect files are written (default ``~/.clorch``, 0700): a home directory is what the
#: nodes of a cluster usually share with the host of the notebook.
CONNECT_DIR_ENV = env_vars.CONNECT_DIR.name
#: A rank not heard from for this long is reported lost (its host or the link to it is gone).
LOST_AFTER_S = 5.0


def default_listen_address() -> str:
    """The address ranks on other hosts reach this one at: the interface of the default route
    (a UDP "connect" picks it; nothing is sent). Loopback when there is no route at all."""
    try:
        return route_address("192.0.2.1")  # TEST-NET-1: any routable address will do
    except OSError:
        return "127.0.0.1"


def connect_file_prefix() -> str:
    """``connect-HOST-PID-``: whose file it is, so that a later start can tell a dead notebook's."""
    return owned_prefix("connect")


def owned_prefix(kind: str) -> str:
    """``KIND-HOST-PID-``: the name of something a notebook leaves on disk while it runs."""
    return f"{kind}-{socket.gethostname()}-{os.getpid()}-"


def remove_stale(directory: str, kind: str) -> str:
    """Remove what notebooks of this host left in ``directory`` when they died (SIGKILL gives no
    chance to clean up): entries named :func:`owned_prefix` with a pid that no longer runs. Other
    hosts' entries (a shared home) are never touched. Returns ``directory``."""
    import shutil

    from ..common.procs import pid_running

    prefix = f"{kind}-{socket.gethostname()}-"
    for name in os.listdir(directory):
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) else ""
        if pid.isdigit() and not pid_running(int(pid)):
            logger.info("clorch_repl: removing %s, left by a notebook (pid %s) that is gone", name, pid)
            path = os.path.join(directory, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                remove_quietly(path)
    return directory


def remove_stale_connect_files(directory: str) -> str:
    """The connect files of this host's dead notebooks (see :func:`remove_stale`)."""
    return remove_stale(directory, "connect")


def connect_dir() -> str:
    """The private directory (0700) for connect files: ``$CLORCH_CONNECT_DIR`` or ``~/.clorch``."""
    path = os.environ.get(CONNECT_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".clorch")
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


@dataclass
class RemotePeer:
    """One nanny, as the notebook knows it."""

    identity: bytes
    rank: int
    hello: dict[str, Any]
    last_seen: float = field(default_factory=time.monotonic)
    #: the kernel's connection info and pid, once the nanny reported them (per kernel start)
    kernel: dict[str, Any] | None = None
    kernel_generation: int = 0
    #: how the current kernel ended ("exit code 3", ...), None while it runs or before it started
    exit: str | None = None
    death_report: str = ""
    #: declared lost (see clorch_repl.launchers.liveness): final for the session; how long it had
    #: been silent then
    lost_after: float | None = None


class CallbackServer:
    """The endpoint ranks call back to (see the module docstring), served by one thread."""

    def __init__(self, listen: str, port: int, connect_file: str, world_size: int,
                 orphan_timeout_s: float = 60.0) -> None:
        self.world_size = world_size
        self._context = zmq.Context.instance()
        public, secret = zmq.curve_keypair()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.curve_server = True
        self._socket.curve_secretkey = secret
        self._socket.curve_publickey = public
        self._socket.linger = 0
        self._socket.router_mandatory = True
        # A nanny names its connection (session:rank:pid); after a TCP reconnect the same name
        # takes over the new connection instead of the nanny becoming a stranger ("lost").
        self._socket.router_handover = True
        try:
            if port:
                self._socket.bind(f"tcp://{listen}:{port}")
            else:
                port = self._socket.bind_to_random_port(f"tcp://{listen}")
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ClorchError(f"cannot listen on {listen}:{port or 'any port'} for ranks to call back ({exc}); "
                              "give --listen an address of this host that the nodes can reach") from None
        self.info = ConnectInfo(listen, port, public.decode(), secrets.token_urlsafe(32), secrets.token_hex(6),
                                orphan_timeout_s)
        self.connect_file = connect_file
        self.info.write(connect_file)
        # re-entrant: wait() calls its predicate under the lock, and predicates use silent_for()
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self.peers: dict[int, RemotePeer] = {}
        #: registrations refused (wrong world, duplicate rank), as messages for the user
        self.refused: list[str] = []
        #: registrations accepted from now on? (the token is one-time: closed once all are in)
        self.open_for_registration = True
        self._outbox: list[tuple[bytes, bytes]] = []
        self._ids = itertools.count(1)
        self._replies: dict[int, dict[str, Any]] = {}
        #: request ids someone still waits for (a late reply to anything else is dropped)
        self._awaited: set[int] = set()
        self._wake_send = self._context.socket(zmq.PAIR)
        self._wake_recv = self._context.socket(zmq.PAIR)
        wake = f"inproc://clorch-callback-{id(self)}"
        self._wake_recv.bind(wake)
        self._wake_send.connect(wake)
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="clorch-callback", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ main thread's side
    def wait(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Block until ``predicate()`` (called under the lock) is true, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(min(left, 0.2))
            return True

    def send(self, rank: int, message: dict[str, Any]) -> None:
        """Queue ``message`` for rank's nanny (sent by the server thread at once)."""
        with self._lock:
            peer = self.peers.get(rank)
            if peer is None:
                raise ClorchError(f"rank {rank} has not called back")
            self._outbox.append((peer.identity, encode(message)))
            self._wake_send.send(b"")

    def request(self, rank: int, op: str, timeout_s: float = 5.0, **args: Any) -> dict[str, Any] | None:
        """Send a request to rank's nanny and wait for its reply (None when none came in time)."""
        reply = self.collect(self.request_async(rank, op, **args), timeout_s)
        if reply is None:
            logger.info("rank %d's nanny did not answer %s within %.1f s", rank, op, timeout_s)
        return reply

    def request_async(self, rank: int, op: str, **args: Any) -> int:
        """Send a request; :meth:`collect` its reply later (several nannies work at once)."""
        rid = next(self._ids)
        with self._lock:
            self._awaited.add(rid)
        self.send(rank, {"op": op, "id": rid, **args})
        return rid

    def collect(self, rid: int, timeout_s: float) -> dict[str, Any] | None:
        """The reply to request ``rid``, or None when none came within ``timeout_s`` (a reply
        coming after that is dropped)."""
        arrived = self.wait(lambda: rid in self._replies, timeout_s)
        with self._lock:
            self._awaited.discard(rid)
            return self._replies.pop(rid) if arrived else None

    def snapshot(self) -> tuple[int, list[str], list[str]]:
        """How many ranks called back, from which hosts, and the refusals so far."""
        with self._lock:
            hosts = sorted({str(p.hello.get("host")) for p in self.peers.values()})
            return len(self.peers), hosts, list(self.refused)

    def silent_for(self, rank: int) -> float:
        """Seconds since rank's nanny was last heard from."""
        with self._lock:
            peer = self.peers.get(rank)
            return 0.0 if peer is None else time.monotonic() - peer.last_seen

    def is_lost(self, rank: int) -> bool:
        """Whether rank was declared lost (latched the first time it is found silent too long)."""
        with self._lock:
            peer = self.peers.get(rank)
            return peer is not None and self._declare(peer, time.monotonic())

    def _declare(self, peer: RemotePeer, now: float) -> bool:
        silent = now - peer.last_seen
        if peer.lost_after is None and liveness.is_lost(False, silent, LOST_AFTER_S):
            peer.lost_after = silent
            logger.warning("clorch_repl: rank %d on %s declared lost (no word for %.0f s)", peer.rank,
                           peer.hello.get("host", "?"), silent)
        return peer.lost_after is not None

    def close(self) -> None:
        """Stop the thread (what is queued goes out first, up to a second) and remove the file."""
        self._closing = True
        with self._lock:
            self._wake_send.send(b"")
        self._thread.join(timeout=5)
        self._wake_send.close()
        remove_quietly(self.connect_file)

    # ------------------------------------------------------------------ the server thread
    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        next_beat = time.monotonic()
        try:
            while not self._closing:
                events = dict(poller.poll(int(HEARTBEAT_S * 1000 / 4)))
                if self._wake_recv in events:
                    while self._wake_recv.poll(0):
                        self._wake_recv.recv()
                if self._socket in events:
                    while self._socket.poll(0):
                        frames = self._socket.recv_multipart()
                        if len(frames) != 2:
                            continue
                        try:
                            self._receive(frames[0], frames[1])
                        except Exception:  # noqa: BLE001 - one odd message must not end the endpoint
                            logger.exception("clorch_repl: a message on the callback endpoint could not be handled")
                now = time.monotonic()
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                    if now >= next_beat:
                        next_beat = now + HEARTBEAT_S
                        beat = encode({"op": ToNanny.HEARTBEAT})
                        # none to a lost rank: its nanny then orphans even if no exit reaches it
                        outbox += [(p.identity, beat) for p in self.peers.values() if not self._declare(p, now)]
                for identity, frame in outbox:
                    try:
                        self._socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
                    except zmq.ZMQError as exc:  # that nanny is gone or not reachable now
                        logger.debug("cannot send to a nanny: %s", exc)
        finally:
            with self._lock:
                outbox, self._outbox = self._outbox, []
            for identity, frame in outbox:  # the last words (exit): sent, with a second to leave
                try:
                    self._socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
                except zmq.ZMQError as exc:
                    logger.debug("cannot send to a nanny: %s", exc)
            self._socket.close(linger=1000)
            self._wake_recv.close()

    def _receive(self, identity: bytes, frame: bytes) -> None:
        message = decode(frame)
        if message is None:
            return
        op = message.get("op")
        if not secrets.compare_digest(str(message.get("token", "")), self.info.token):
            if op == FromNanny.REGISTER:  # a start must fail loudly on a stale or foreign connect file
                with self._changed:
                    self._refuse(identity, f"rank {message.get('rank')} on {message.get('host', '?')} called back "
                                           "with a wrong token (a stale or foreign connect file?)")
                    self._changed.notify_all()
            else:
                logger.warning("clorch_repl: dropped a message without the session's token on the callback endpoint")
            return
        with self._changed:
            if op == FromNanny.REGISTER:
                self._register(identity, message)
            else:
                peer = next((p for p in self.peers.values() if p.identity == identity), None)
                if peer is None:
                    logger.info("clorch_repl: dropped %r from a connection that never registered", op)
                    return
                if self._declare(peer, time.monotonic()):
                    answer = liveness.answer_to_lost(peer.rank, str(peer.hello.get("host", "?")), op,
                                                     peer.lost_after or 0.0)
                    if answer is not None:
                        self._outbox.append((identity, encode(answer)))
                    if op == FromNanny.EXITED:
                        peer.exit = str(message.get("how", "ended"))
                    return
                peer.last_seen = time.monotonic()
                if op == FromNanny.KERNEL:
                    info = message.get("info")
                    peer.kernel = {**info, "pid": message.get("pid")} if isinstance(info, dict) else None
                    peer.kernel_generation += 1
                    peer.exit = None
                elif op == FromNanny.EXITED:
                    peer.exit = str(message.get("how", "ended"))
                    peer.death_report = str(message.get("report", ""))
                elif op == FromNanny.REPLY:
                    rid = message.get("id")
                    if rid in self._awaited:
                        self._replies[rid] = message
            self._changed.notify_all()

    def _register(self, identity: bytes, message: dict[str, Any]) -> None:
        host = str(message.get("host", "?"))
        try:
            rank, world = int(message["rank"]), int(message["world_size"])
        except (KeyError, TypeError, ValueError):
            self._refuse(identity, f"a registration from {host} without a rank and world size")
            return
        wrong = mismatch(message.get("protocol"), f"rank {rank} on {host}")
        if wrong:
            self._refuse(identity, wrong)
        elif not self.open_for_registration:
            self._refuse(identity, f"rank {rank} on {host} called back after the session had started "
                                   "(its token is used up)")
        elif world != self.world_size:
            self._refuse(identity, f"rank {rank} on {host} says the world has {world} ranks; this session "
                                   f"expects {self.world_size} (--nodes x --nproc-per-node)")
        elif not 0 <= rank < self.world_size:
            self._refuse(identity, f"rank {rank} on {host} is outside 0..{self.world_size - 1}")
        elif rank in self.peers and self.peers[rank].identity != identity:
            self._refuse(identity, f"rank {rank} called back twice: from {self.peers[rank].hello.get('host')} "
                                   f"and from {host}")
        else:
            self.peers[rank] = RemotePeer(identity, rank, message)

    def _refuse(self, identity: bytes, why: str) -> None:
        self.refused.append(why)
        logger.warning("clorch_repl: refused a rank: %s", why)
        self._outbox.append((identity, encode({"op": ToNanny.REFUSED, "why": why})))
