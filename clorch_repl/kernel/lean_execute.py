"""The lean execute path of a rank's kernel: how the relay's own execute requests are run.

An empty cell cost a rank about 2 ms of CPU in ipykernel's path, most of it not the cell's. The
relay's requests (one signed frame, :mod:`clorch_repl.wire.framing`) take :class:`LeanExecute`'s
path instead; every other client (a console attached to a rank, a debugger) gets ipykernel's.
The reply carries the number of iopub messages the request sent, which is how the relay knows the
cell is over without an idle status.

A mixin of :class:`clorch_repl.kernel.rank_kernel.RankKernel`, which supplies ``do_execute``.
Imported on a rank only (ipykernel at module level).
"""

from __future__ import annotations

import _signal
import logging
import os
import sys
import time
from signal import SIGINT, default_int_handler

from ipykernel.jsonutil import json_clean
from jupyter_client.session import extract_header
import zmq
from zmq.eventloop.zmqstream import ZMQStream

from ..wire.limits import Limits
from ..wire.framing import (CELL_NUMBER_KEY, COMPACT_REPLY_KEY, COUNTED_KEY, IOPUB_COUNT_KEY, OUTPUT_LIMITS_KEY,
                            MessageEncoder, compact_reply, lean_reply, read_lean_execute)

logger = logging.getLogger(__name__)

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class LeanExecute:
    """The relay's execute requests through :meth:`_lean_execute`, and the count of the iopub
    messages each one sends (a mixin before ipykernel's kernel class, whose attributes it uses)."""

    #: (msg_id, one entry per iopub message sent for it) while a lean request runs
    _counting: tuple[str, list[None]] | None = None
    #: the output limits the running lean request asked for, taken by the kernel's do_execute
    _next_limits: Limits | None = None
    #: signs the replies to lean requests (made at the first one, with the kernel's session)
    _reply_encoder: MessageEncoder | None = None

    @property
    def _supports_kernel_subshells(self) -> bool:
        return bool(self.shell_channel_thread)  # type: ignore[attr-defined]  # False without that thread

    def _count_iopub(self) -> None:
        """Count the iopub messages each lean request sends (wire.IOPUB_COUNT_KEY), at the one
        place every one of them passes: the kernel's Session.send, shared by its streams
        (from the IOPub thread), display publisher, display hook, errors and comms.

        Each counted message is marked (wire.COUNTED_KEY in its metadata) and the relay
        counts only marked ones: the cell's forked children (a multiprocessing pool, a
        DataLoader's workers) print through ipykernel's pipe, whose messages the rank's IOPub
        thread forwards as they are, and a child (which inherits this wrapper) marks nothing,
        so neither side counts them, and they cannot complete the count before the rank's
        own messages came. A message is
        counted once it was sent: one that failed to serialise (a display of an object JSON
        cannot hold) is not waited for. A list's append is atomic under the GIL, which the
        two threads need; len() is read on the main thread once the streams' flush has
        waited for their sends."""
        send = self.session.send
        kernel = self
        own = os.getpid()  # a forked child inherits this wrapper and the count: it counts nothing

        def counted(stream, msg_or_type, content=None, parent=None, *args, **kwargs):  # type: ignore[no-untyped-def]
            counting = kernel._counting
            if (counting is None or os.getpid() != own
                    or not (stream is kernel.iopub_socket or stream is kernel.iopub_thread)):
                return send(stream, msg_or_type, content, parent, *args, **kwargs)
            whole = isinstance(msg_or_type, dict)  # the display hook's execute_result, streams
            header = msg_or_type.get("parent_header") if whole else extract_header(parent)
            if (header or {}).get("msg_id") != counting[0]:
                return send(stream, msg_or_type, content, parent, *args, **kwargs)
            if whole:
                msg_or_type["metadata"] = {**(msg_or_type.get("metadata") or {}), COUNTED_KEY: True}
            elif len(args) >= 5:  # metadata given by position (ident, buffers, track, header, metadata)
                args = (*args[:4], {**(args[4] or {}), COUNTED_KEY: True}, *args[5:])
            else:
                kwargs["metadata"] = {**(kwargs.get("metadata") or {}), COUNTED_KEY: True}
            sent = send(stream, msg_or_type, content, parent, *args, **kwargs)
            counting[1].append(None)
            return sent

        self.session.send = counted

    def pre_handler_hook(self) -> None:
        """ipykernel's (SIGINT raises KeyboardInterrupt while a request is handled), through the
        C function the ``signal`` module wraps. The wrapper turns each handler into an enum and
        back, and for a handler that is a function (ipykernel's own between requests) finds it is
        none by raising and catching a ValueError: three such calls a cell, about 15 us of a
        rank's 0.5 ms of CPU for an empty cell on the 2-core box. The saved handler is the raw one
        (a function, or 0 / 1 for SIG_DFL / SIG_IGN), which only :meth:`post_handler_hook` reads."""
        self.saved_sigint_handler = _signal.signal(SIGINT, default_int_handler)

    def post_handler_hook(self) -> None:
        """ipykernel's: SIGINT back to what it was before the request (see :meth:`pre_handler_hook`)."""
        _signal.signal(SIGINT, self.saved_sigint_handler)

    async def dispatch_shell(self, msg, /, subshell_id=None, *, concurrent=False):  # type: ignore[no-untyped-def]
        """The relay's execute requests take :meth:`_lean_execute`; everything else ipykernel's path.

        Also while ipykernel aborts queued requests after another client's failed cell: the
        relay never asks for that (stop_on_error is off in its requests), and ipykernel's path
        could not read a lean request's frame (wire.LEAN_MAGIC)."""
        lean = None
        if not concurrent and subshell_id is None and self.session:
            try:
                lean = read_lean_execute(self.session, msg)
            except (ValueError, TypeError, KeyError, UnicodeError) as exc:  # ipykernel's path refuses it
                self.log.debug("not a lean execute request: %s", exc)
        if lean is None:
            return await super().dispatch_shell(msg, subshell_id=subshell_id, concurrent=concurrent)
        await self._lean_execute(*lean)

    async def _lean_execute(self, idents: list[bytes], parent: dict) -> None:
        """ipykernel's dispatch_shell and execute_request for one of the relay's execute
        requests (wire.LEAN_KEY), minus what only costs a rank time. Not sent: busy and
        execute_input on iopub, which nothing reads (the relay knows a rank is busy from
        the request it sent, and what code it sent); each cost the rank a wake of its IOPub
        thread mid-cell and the notebook a message to read. Not done: ipykernel's debug log
        records, dateutil parsing of the header, the reply's trip through the stream's send
        queue, and Jupyter's seven frames for the reply (one compact frame, wire.compact_reply,
        or where the request does not ask for it one lean frame, wire.lean_reply: only the relay
        reads it). Kept, in ipykernel's order: the parent (output, prompts and comms belong to
        the request), SIGINT as KeyboardInterrupt while the code runs, do_execute (IPython's
        run_cell: history, display hook, events, errors), the streams flushed before the
        reply, the reply, the queue aborted after an error when asked.

        Nor the idle status: the reply says how many iopub messages the request sent
        (wire.IOPUB_COUNT_KEY), and the relay ends the rank's part of the cell once it has
        read the reply and that many: the idle's only news, that nothing more of the cell
        is coming, at the cost of no message. The idle cost a wake of the IOPub thread,
        a signed message, and about 0.2 ms of the cell's round trip spent waiting for it
        after the reply. A request whose handler failed before replying still ends with
        the idle status, which the relay also reads."""
        stream = (self.shell_channel_thread.manager.get_subshell_to_shell_channel_socket(None)
                  if self._supports_kernel_subshells else self.shell_stream)
        self._counting = (parent["msg_id"], [])
        self.set_parent(idents, parent, channel="shell")
        try:
            self.pre_handler_hook()
        except Exception:  # noqa: BLE001 - as ipykernel: the cell runs without it
            self.log.debug("Unable to signal in pre_handler_hook:", exc_info=True)
        replied = False
        try:
            replied = await self._lean_execute_request(stream, idents, parent)
        except Exception:  # noqa: BLE001 - as ipykernel: logged, the kernel goes on
            self.log.error("Exception in message handler:", exc_info=True)
        except KeyboardInterrupt:
            self._uninterruptible()
            self.log.error("KeyboardInterrupt caught in kernel.")
        finally:
            self._counting = None
            self._uninterruptible()
        _flush_streams()
        if replied:
            if isinstance(stream, ZMQStream) and stream.sending():
                stream.flush()  # the reply went through the stream's queue: send it now
        elif isinstance(stream, ZMQStream) and not stream.sending():
            self._publish_status("idle", "shell")  # no reply: the idle ends the relay's wait
        else:
            self._publish_status_and_flush("idle", "shell", stream)

    def _uninterruptible(self) -> None:
        """SIGINT back to what it was between requests (ipykernel's post_handler_hook: ignored),
        even if one more arrives while that is done (its KeyboardInterrupt is dropped: the cell's
        code is over, there is nothing left for it to interrupt)."""
        while True:
            try:
                self.post_handler_hook()
                return
            except KeyboardInterrupt:
                continue
            except Exception:  # noqa: BLE001 - as ipykernel: the request goes on without it
                self.log.debug("Unable to signal in post_handler_hook:", exc_info=True)
                return

    async def _lean_execute_request(self, stream, idents: list[bytes], parent: dict) -> bool:  # type: ignore[no-untyped-def]
        """Run the request and reply, with the count of its iopub messages; True once replied."""
        content = parent["content"]
        code = content["code"]
        silent = content.get("silent", False)
        store_history = content.get("store_history", not silent)
        cell_meta = parent.get("metadata") or {}
        args = {"code": code, "silent": silent, "store_history": store_history,
                "user_expressions": content.get("user_expressions", {}),
                "allow_stdin": content.get("allow_stdin", False)}
        if self._do_exec_accepted_params["cell_meta"]:
            args["cell_meta"] = cell_meta
        if self._do_exec_accepted_params["cell_id"]:
            args["cell_id"] = cell_meta.get("cellId")
        compact = bool(cell_meta.get(COMPACT_REPLY_KEY))
        metadata = {} if compact else self.init_metadata(parent)  # only a Jupyter-form reply carries it
        self._next_limits = Limits.from_wire(cell_meta.get(OUTPUT_LIMITS_KEY))
        if not silent:
            self.execution_count += 1  # what ipykernel does (IPythonKernel counts in its shell)
            number = cell_meta.get(CELL_NUMBER_KEY)
            if isinstance(number, int) and not isinstance(number, bool) and number >= 0:
                self.shell.execution_count = number  # the notebook's [n] (wire.CELL_NUMBER_KEY)
        reply_content = await self.do_execute(**args)
        # The user's code has returned: an interrupt from here on would only cut the reply (or
        # the idle) on its way out, and the relay would wait for this rank for good (seen: a
        # rank left "still running an earlier cell" after an interrupt that came as a cell ended).
        self._uninterruptible()
        _flush_streams()
        if self._execute_sleep:
            time.sleep(self._execute_sleep)
        reply_content = json_clean(reply_content)
        count = len(self._counting[1]) if self._counting is not None else None  # the streams are flushed
        if self._reply_encoder is None:
            self._reply_encoder = MessageEncoder(self.session)
        if compact and count is not None:
            frame = compact_reply(self._reply_encoder, self.session, parent["msg_id"], count, reply_content)
        else:  # (a compact request without a count, which _lean_execute always sets, would stamp "started" late)
            metadata = self.finish_metadata(parent, metadata or self.init_metadata(parent), reply_content)
            if count is not None:
                metadata[IOPUB_COUNT_KEY] = count
            frame = lean_reply(self._reply_encoder, self.session, "execute_reply", reply_content, parent, metadata)
        if isinstance(stream, ZMQStream) and not stream.sending():
            # this thread's own socket, nothing queued before: send now, past the stream's queue
            stream.socket.send_multipart([*idents, frame])  # one frame: only the relay reads it (wire.compact_reply)
            _rearm(stream)
        else:
            stream.send_multipart([*idents, frame])
        if not silent and reply_content["status"] == "error" and content.get("stop_on_error", True):
            self._abort_queues(None)
        return True


def _rearm(stream: ZMQStream) -> None:
    """Have ``stream`` read the requests that came while the cell ran, after a send on its socket
    past the stream.

    A ZeroMQ socket's file descriptor is edge-triggered: it signals once when commands wait for
    the socket (a new peer, a peer's first message into an empty pipe), and any call on the socket,
    a send included, processes them and clears it. ZMQStream re-checks the socket's events after
    each of its own sends and receives, but not after ours: a request that arrived while the cell
    ran (another client's, or a kernel connecting to a detached session while the rank finished
    the last kernel's cell) was left unread, and so were the requests its sender queued after it
    into the same pipe (they signal nothing), until another peer connected. Measured: a client's
    kernel_info sent during a 6 s lean cell, and every one it sent in the 60 s after, went
    unanswered; ipykernel's own execute path (sends through the stream) answered at 5.0 s."""
    if stream.socket.get(_EVENTS) & _POLLIN:  # plain ints: pyzmq's enums cost a Python call each
        stream.io_loop.add_callback(stream.flush, _POLLIN)


def _flush_streams() -> None:
    """The cell's stdout and stderr flushed, as ipykernel flushes them around a request."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
