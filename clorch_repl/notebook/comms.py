"""Comms between the notebook's front end and the ranks: what makes widgets created on a rank
(ipywidgets, ``tqdm.auto`` / ``tqdm.notebook`` bars) render in the notebook and stay interactive.

A front end (JupyterLab) talks to one kernel, the notebook's; a widget made on a rank is a comm
of that rank's kernel. The bridge stands in for every rank comm inside the notebook kernel:

* rank -> front end: the relay hands each comm_open / comm_msg / comm_close a rank published to
  :meth:`CommBridge.from_rank`, which republishes it on the notebook kernel's iopub, unchanged
  (data, metadata, binary buffers), with the notebook's current request as parent (the running
  ``%%distributed`` cell). A comm_open also registers a proxy comm under the rank's comm id in
  the notebook kernel's comm manager. While a cell runs, the display publishes them in the
  rank's own order with its output (a widget's comm_open before its view, its comm_close
  after); the view itself is a display_data, shown under the rank's label like any rich output.
* front end -> rank: the notebook kernel's comm manager hands the front end's comm_msg /
  comm_close for a rank comm to its proxy, which sends it on to the owning rank's shell, signed
  with that rank's key. The notebook kernel handles these only between its own cells (its shell
  is busy while a cell runs, so the front end's messages wait, as for any kernel). After sending,
  the bridge reads what the ranks send until the rank's idle status for that message (at most
  :data:`SETTLE_S`), so the rank's answer (ipywidgets' echo of a new value, a bar the callback
  updates) reaches the front end at once.

Comm ids are not mapped: ipywidgets (8.x) and ipykernel name comms with ``uuid4().hex`` (122
random bits), so two ranks' ids do not collide in practice, and mapping them would mean rewriting
every ``IPY_MODEL_<id>`` reference inside widget state (a tqdm bar is a box referring to three
child widgets). A rank comm whose id is already taken (by the notebook's own comm, or another
rank's) is refused with a warning instead of being mixed up.

Between cells, the notebook kernel's own event loop reads the ranks every :data:`TICK_S` (a
timer on the loop that runs the kernel's message handlers, so on the main thread, never while a
cell or a handler runs: the relay's ZeroMQ sockets, which are not thread-safe, are never used
from two threads). What a rank's thread does to a widget after its cell ended (a bar it keeps
updating) thus reaches the front end live. Output such a thread prints still waits for the next
cell, as before; while :data:`LATE_LIMIT` pieces of it wait, the timer stops reading and ZeroMQ's
queues hold the rest. Without a running event loop (IPython in a terminal), traffic is forwarded
at the next read: the next cell, ``%clorch status``, a front end's widget message.

When the ranks go (``%clorch stop``/``restart``, the notebook kernel's exit) the proxies are
unregistered without telling the front end: views already shown keep their last state (a
finished bar stays as it ended) and stop being interactive.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import warnings
from typing import Any, Protocol

import zmq
from jupyter_client.blocking.client import BlockingKernelClient

from . import widget_states

logger = logging.getLogger(__name__)

#: How long a front end's message to a rank may wait to be queued before it is dropped.
SEND_TIMEOUT_MS = 1000
#: After a front end's message is sent to a rank, how long its answer is waited for (the notebook
#: kernel is busy meanwhile); whatever comes later is forwarded at the next read.
SETTLE_S = 2.0
#: Between cells, how often the notebook kernel's event loop reads the ranks (see the module doc):
#: a zero-timeout poll, a few microseconds when nothing came.
TICK_S = 0.1
#: Between cells, at most this many pieces of output are read ahead of the next cell.
LATE_LIMIT = 1000


def notebook_kernel() -> Any | None:
    """The ipykernel this runs in, or None (a terminal IPython: no front end takes comms)."""
    try:
        from ipykernel.kernelbase import Kernel
    except ImportError:
        return None
    return Kernel.instance() if Kernel.initialized() else None


@functools.cache
def _proxy_class() -> type:
    from ipykernel.comm.comm import BaseComm

    class RankComm(BaseComm):
        """The notebook kernel's stand-in for one rank's comm (never primary: the rank opened it)."""

        rank: int = -1

    return RankComm


class RankChannels(Protocol):
    """What the bridge needs of the relay (:class:`~clorch_repl.session.relay.Relay`), and no more."""

    @property
    def connected(self) -> bool:
        """Whether the ranks' channels are open."""

    def client(self, rank: int) -> BlockingKernelClient | None:
        """``rank``'s channels (its shell socket and session key), None when it has none."""

    def down(self, rank: int) -> str | None:
        """Why ``rank``'s process is not running, or None while it is."""

    def idle(self, rank: int) -> bool:
        """Whether ``rank`` runs no request of the relay's."""

    def settle(self, rank: int, msg_id: str, timeout_s: float) -> bool:
        """Route the ranks' messages until ``rank``'s idle status for ``msg_id``, at most ``timeout_s``."""

    def pump_between_cells(self, late_limit: int) -> None:
        """Route what has arrived, without waiting."""


class CommBridge:
    """Forwards one session's comm traffic between the notebook's front end and its ranks."""

    def __init__(self, relay: RankChannels) -> None:
        self.relay = relay
        self.kernel = notebook_kernel()
        #: comm id -> the proxy registered for it in the notebook kernel's comm manager
        self.proxies: dict[str, Any] = {}
        self._refused: set[tuple[int, str]] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the rank widgets' current state, for a front end that reconnects (widget_states)
        self.states = widget_states.WidgetStates()
        if self.kernel is not None:
            widget_states.register(self.states)
            try:
                self._loop = asyncio.get_running_loop()  # the kernel's: we are inside its cell
            except RuntimeError:
                logger.debug("no running event loop: rank widget traffic between cells waits for the next read")
            else:
                self._timer = self._loop.call_later(TICK_S, self._tick)

    @property
    def active(self) -> bool:
        """Whether there is a front end to forward to (a notebook kernel, not a terminal)."""
        return self.kernel is not None

    # ------------------------------------------------------------------- rank -> front end
    def from_rank(self, rank: int, msg: dict[str, Any]) -> None:
        """Republish a rank's comm message on the notebook kernel's iopub (see the module doc).

        A message that cannot be republished is logged and dropped: a widget's trouble must not
        fail the cell whose output it is part of."""
        if self.kernel is None:
            return
        try:
            self._from_rank(rank, msg)
        except Exception:  # noqa: BLE001 - logged; the cell goes on
            logger.exception("could not forward rank %d's %s to the front end", rank, msg.get("msg_type"))

    def _from_rank(self, rank: int, msg: dict[str, Any]) -> None:
        msg_type = msg["msg_type"]
        content = msg.get("content") or {}
        comm_id = content.get("comm_id")
        if not isinstance(comm_id, str) or not comm_id:
            logger.warning("rank %d sent a %s without a comm id; dropped", rank, msg_type)
            return
        if (rank, comm_id) in self._refused:
            return
        metadata = msg.get("metadata") or {}
        buffers = list(msg.get("buffers") or ()) or None
        if msg_type == "comm_open":
            proxy = self._open(rank, comm_id, content)
            if proxy is None:
                return
            proxy.publish_msg("comm_open", data=content.get("data") or {}, metadata=metadata, buffers=buffers,
                              target_name=proxy.target_name, target_module=content.get("target_module"))
            self.states.opened(comm_id, content, buffers)
            return
        proxy = self.proxies.get(comm_id)
        if proxy is None or proxy.rank != rank:
            logger.debug("rank %d: %s for comm %s that the front end never saw opened; dropped",
                         rank, msg_type, comm_id)
            return
        if msg_type == "comm_msg":
            proxy.publish_msg("comm_msg", data=content.get("data") or {}, metadata=metadata, buffers=buffers)
            self.states.updated(comm_id, content.get("data") or {}, buffers)
        elif msg_type == "comm_close":
            proxy.publish_msg("comm_close", data=content.get("data") or {}, metadata=metadata, buffers=buffers)
            self._forget(comm_id)

    def _open(self, rank: int, comm_id: str, content: dict[str, Any]) -> Any | None:
        import comm

        manager = comm.get_comm_manager()
        taken = manager.comms.get(comm_id)
        if taken is not None:
            owner = getattr(taken, "rank", None)
            if owner == rank:  # the rank reopened its own comm: the new open replaces it
                self._forget(comm_id)
            else:
                who = "the notebook's own comm" if owner is None else f"a comm of rank {owner}"
                self._refused.add((rank, comm_id))
                warnings.warn(f"clorch_repl: rank {rank} opened comm {comm_id}, whose id is already {who}; "
                              "its widget is not shown (give the widgets distinct model ids)",
                              RuntimeWarning, stacklevel=2)
                return None
        proxy = _proxy_class()(comm_id=comm_id, primary=False, target_name=content.get("target_name") or "comm",
                               target_module=content.get("target_module"))
        proxy.kernel = self.kernel
        proxy.rank = rank
        proxy.on_msg(lambda msg, _id=comm_id: self.to_rank(_id, "comm_msg", msg))
        proxy.on_close(lambda msg, _id=comm_id: self.to_rank(_id, "comm_close", msg))
        manager.register_comm(proxy)
        self.proxies[comm_id] = proxy
        return proxy

    def _forget(self, comm_id: str) -> None:
        import comm

        proxy = self.proxies.pop(comm_id, None)
        self.states.closed(comm_id)
        if proxy is None:
            return
        proxy._closed = True  # never publish a comm_close of its own (BaseComm does on garbage collection)
        manager = comm.get_comm_manager()
        if manager.comms.get(comm_id) is proxy:
            manager.unregister_comm(proxy)

    # ------------------------------------------------------------------- front end -> rank
    def to_rank(self, comm_id: str, msg_type: str, msg: dict[str, Any]) -> None:
        """Send a front end's message for a rank comm to that rank, then forward its answer."""
        proxy = self.proxies.get(comm_id)
        if proxy is None:
            return
        rank = proxy.rank
        if msg_type == "comm_close":
            self._forget(comm_id)  # the comm manager has already let go of it
        client = self.relay.client(rank)
        if client is None:
            return
        exit = self.relay.down(rank)
        if exit is not None:
            # A DEALER socket with no live peer blocks its sender: never try, say why it is dropped.
            warnings.warn(f"clorch_repl: rank {rank} is not running ({exit}); "
                          f"its widget's {msg_type} was dropped (%clorch restart starts the ranks again)",
                          RuntimeWarning, stacklevel=2)
            return
        content = dict(msg.get("content") or {})
        content["comm_id"] = comm_id
        buffers = [bytes(b) for b in (msg.get("buffers") or ())]
        if msg_type == "comm_msg":  # a slider the user moved: its new value is the widget's state now
            self.states.updated(comm_id, content.get("data") or {}, buffers)
        socket = client.shell_channel.socket
        previous = socket.getsockopt(zmq.SNDTIMEO)
        # Bounded: a rank that stopped reading (its queue at the high-water mark) or died just now
        # must not hang the notebook kernel, which runs this on its main thread.
        socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        try:
            sent = client.session.send(socket, msg_type, content,
                                       metadata=msg.get("metadata") or {}, buffers=buffers or None)
        except zmq.Again:
            warnings.warn(f"clorch_repl: rank {rank} did not take its widget's {msg_type} within "
                          f"{SEND_TIMEOUT_MS} ms (its queue is full or it is gone); the message was dropped",
                          RuntimeWarning, stacklevel=2)
            return
        finally:
            socket.setsockopt(zmq.SNDTIMEO, previous)
            self.relay.channels.touched(rank)  # the send may have taken the wake-up of a reply there
        # A rank still busy with an earlier request (a cell that was cut short) answers when it
        # is done: not waited for, or every message of a dragged slider would block the notebook.
        if self.relay.down(rank) is None and self.relay.idle(rank):
            self.relay.settle(rank, sent["header"]["msg_id"], SETTLE_S)

    # ----------------------------------------------------------------------------- lifetime
    def _tick(self) -> None:
        """Between cells, on the kernel's event loop: forward what the ranks sent meanwhile."""
        if self._loop is None:
            return
        try:
            if self.relay.connected:
                self.relay.pump_between_cells(LATE_LIMIT)
        except Exception:  # noqa: BLE001 - logged; the next cell reads (and reports) the ranks again
            logger.exception("reading the ranks between cells failed")
        self._timer = self._loop.call_later(TICK_S, self._tick)

    def close(self) -> None:
        """The ranks are going: their proxies leave the notebook kernel's comm manager."""
        self._loop = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for comm_id in list(self.proxies):
            self._forget(comm_id)
        self._refused.clear()
        widget_states.unregister(self.states)
