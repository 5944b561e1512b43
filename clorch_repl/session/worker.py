"""Entry point of one rank's kernel process: ``python -m clorch_repl.session.worker -f CONN``.

The kernel is started by the rank's :mod:`.supervisor`, which ends it and everything it started
when the notebook is gone or the rank is stopped. A rank is a plain ipykernel with these additions:

* ``SIGUSR1`` dumps the Python stack of the main thread into the rank's stack file, from a C-level
  signal handler, so the notebook can show where a rank that ignores Ctrl-C is stuck (a hung
  collective blocks in C++ and never sees KeyboardInterrupt);
* ``quiet=False`` echoes everything the rank prints to its real stdout/stderr, which the session
  points at the rank's log file, so ``%clorch logs`` holds Python and native output alike; a
  cell's traceback (KeyboardInterrupt too) is written there as well, and ipykernel's start-up
  banner ("To connect another client...") is not, since it is no output of the rank's;
* ``\r`` progress updates are coalesced before they are published (see ``RankOutStream``);
* the relay's execute requests take a lean path through the kernel (``RankKernel._lean_execute``):
  an empty cell cost a rank about 2 ms of CPU in ipykernel's, most of it not the cell's;
* no shell-channel thread: ipykernel 7 reads the shell socket on a thread of its own and hands each
  request to the main thread (and each reply back) over an inproc socket, a thread hop each way
  per cell for the subshells that nothing here uses; a rank reads and answers on its main thread,
  as ipykernel 6 did and ipykernel 7 still does for a kernel without that thread;
* a watchdog thread ends the kernel when its supervisor is gone (the supervisor itself needs no
  GIL to end the kernel; this thread only covers a supervisor killed outright);
* a warm spare (``CLORCH_SPARE`` set; :mod:`clorch_repl.launchers.local`) imports torch and what
  joining a group needs before its kernel starts, and learns its group only when it is made a rank;
* with ``CLORCH_CPU_BIND=numa`` the process binds itself to the CPU cores of its GPU's NUMA node
  (:mod:`clorch_repl.numa`) before any thread starts, so every thread the kernel runs inherits
  it; what it did or why it could not is written to the rank's log, and nothing there stops it.

The process group itself is initialised later by :mod:`clorch_repl.session.bootstrap`, through
the kernel, so that its failures arrive as ordinary tracebacks.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import types

from .. import numa
from .display_log import log_displays
from .rank_stdin import StdinPolicy
from .rank_tracebacks import interrupts_at_users_line
from ..procs import end_own_group, watch_parent
from ..diagnosis.probe import PROBE_REQUEST as _PROBE_REQUEST
from .flood import Budget, Limits
from .wire import CELL_NUMBER_KEY, COUNTED_KEY, IOPUB_COUNT_KEY, OUTPUT_LIMITS_KEY, read_lean_execute

logger = logging.getLogger(__name__)

#: quiet=False: Python-level output is echoed to the process's stdout/stderr, i.e. the rank's log.
#: capture_fd_output=False: native output (NCCL, C++ warnings) goes straight to the log, once.
#: HistoryManager.enabled=False: no SQLite history database per rank; writing it cost a rank
#: about 3 ms per cell here, more than the rest of a cell's round trip. In/Out still work.
#: outstream_class: see RankOutStream; kernel_class: see RankKernel. _execute_sleep=0: ipykernel
#: sleeps 0.5 ms after every cell so that a client reading the shell reply first is less likely
#: to miss late output; the relay drains iopub for a moment after the reply instead.
KERNEL_OPTIONS = ("--IPKernelApp.quiet=False", "--IPKernelApp.capture_fd_output=False",
                  "--HistoryManager.enabled=False",
                  "--IPKernelApp.outstream_class=clorch_repl.session.worker.RankOutStream",
                  "--IPKernelApp.kernel_class=clorch_repl.session.worker.RankKernel",
                  "--IPythonKernel._execute_sleep=0",
                  # ipykernel's own parent poller would watch the supervisor; ours does.
                  "--IPKernelApp.parent_handle=0")
STACK_FILE_ENV = "CLORCH_STACK_FILE"
#: A user's flush of a line that only rewrote the current line (``\r``) within this long of the
#: last send is left to the stream's own timed flush (ipykernel's flush_interval, 0.2 s).
COALESCE_S = 0.1
#: True while a cell's code runs; outside it (the kernel's own flush at a cell's end) every
#: flush is done, so nothing of a cell is published after the cell's reply.
_in_cell = False
#: This rank's output budget for the running (or last) cell (clorch_repl.session.flood): what it
#: refuses goes to the rank's log only. One for stdout and stderr together, shared by the cell's
#: threads (hence the lock); kept after the cell, so a thread the cell left printing stays bounded.
_budget: Budget | None = None
_budget_lock = threading.Lock()
_budget_pid = os.getpid()  # a forked child (a DataLoader worker) publishes through its own pipe


def _admit(string: str) -> bool:
    """Whether the cell's budget lets ``string`` be published (it is echoed to the log either way)."""
    __tracebackhide__ = True  # a KeyboardInterrupt landing here is the user's print's, not ours
    budget = _budget
    if budget is None or os.getpid() != _budget_pid:
        return True
    with _budget_lock:
        return budget.admit(string, time.monotonic())


def _start_budget(limits: Limits, silent: bool = False) -> None:
    """A cell starts: a fresh budget. What the last one held after its cell's line (a thread
    that cell left printing) is said first, so that nothing is held back unannounced; by the
    next cell of the user's when this one is ``silent`` (clorch_repl's own request: a join, a
    transfer, whose output is not where a user looks for a notice about an earlier cell)."""
    global _budget
    with _budget_lock:
        previous, _budget = _budget, None
    fresh = Budget(limits, time.monotonic())
    line = None
    if previous is not None and silent:
        fresh.carry_late(previous)
    elif previous is not None:
        line = previous.late_line(os.environ.get("RANK", "?"))
    try:
        if line is not None and sys.stderr is not None:
            sys.stderr.write(line)
    finally:
        with _budget_lock:
            _budget = fresh


def _publish_held_back() -> None:
    """At the cell's end: the one line saying how much this rank held back (before the streams'
    last flush, so that the reply counts it). Published whatever the budget says."""
    global _budget
    with _budget_lock:
        budget, _budget = _budget, None
    if budget is None:
        return
    line = budget.held_back_line(os.environ.get("RANK", "?"))
    budget.mark_announced()  # published with the cell's output (a transfer's too): said once
    try:
        if line is not None and sys.stderr is not None:
            sys.stderr.write(line)
    finally:
        with _budget_lock:
            if _budget is None:
                _budget = budget


def _echo(echo: object, string: str) -> None:
    """To the rank's log, as ipykernel's own echo does (its errors to the real stderr)."""
    if echo is not None:
        try:
            echo.write(string)  # type: ignore[attr-defined]
        except OSError as exc:
            print(f"Write failed: {exc}", file=sys.__stderr__)


def _out_stream_class() -> type:
    from ipykernel.iostream import OutStream

    # Coalescing edits ipykernel 7's per-parent buffers (``_buffers``, filled by ``write`` and
    # emptied by ``_flush_buffers``) in place. An ipykernel built otherwise (the package pins 7,
    # but a site may force another) gets ipykernel's own writes: correct, only not coalesced.
    coalescing = all(hasattr(OutStream, name) for name in ("_is_master_process", "_flush_buffers"))

    class RankOutStream(OutStream):
        """ipykernel's stream, minus work that a flood of output would multiply.

        * A flush of a stream nothing was written to is skipped: ipykernel flushes stdout and
          stderr around every cell, and each flush from the main thread waits for two hops
          through the IOPub thread, over a millisecond per cell here.
        * A flush returns once its text has been handed to the iopub socket (see ``flush``).
        * ``\r`` progress updates are coalesced: a write whose last ``\r`` starts a rewrite of
          the current line replaces what the buffer still holds of that line (the notebook shows
          only a progress line's last state anyway), and while a cell runs, a user's flush of
          nothing but such rewrites within :data:`COALESCE_S` of the last send is left to the
          timed flush that every write schedules. A tqdm with ``mininterval=0`` then publishes
          about ten messages a second instead of one per update: 300,000 flushed updates used
          to be 300,000 iopub messages, past ZeroMQ's high-water mark, and the relay lost
          messages. The rank's log still gets every write (the echo happens first).
        """

        _clean = False
        _rewrite_only = False
        _last_send = 0.0

        def write(self, string: str) -> int | None:
            __tracebackhide__ = True  # see _admit
            self._clean = False
            # A "\r" rewrite of the current line is not counted: coalescing (below) already bounds
            # what it publishes to about ten messages a second, and the bar's last state must show.
            rewrite = isinstance(string, str) and "\r" in string and "\n" not in string
            if isinstance(string, str) and string and not rewrite and not _admit(string):
                _echo(self.echo, string)  # held back: the rank's log still gets it (see flood)
                return len(string)
            if (not isinstance(string, str) or self.pub_thread is None or not coalescing
                    or not self._is_master_process()):
                return super().write(string)  # its errors, and forked children, as ipykernel does them
            p = string.rfind("\r")
            if p < 0 or p + 1 == len(string) or "\n" in string[p:]:
                self._rewrite_only = False
                nl = string.rfind("\n")
                with self._buffer_lock:
                    key = frozenset(self.parent_header.items())
                    result = super().write(string)
                    if nl >= 0:
                        buf = self._buffers[key]
                        self._line_starts[key] = (buf, buf.tell() - (len(string) - nl - 1))
                return result
            _echo(self.echo, string)
            with self._buffer_lock:
                key = frozenset(self.parent_header.items())
                buf = self._buffers[key]
                nl = string.rfind("\n", 0, p)
                if nl >= 0:
                    buf.write(string[:nl + 1])  # lines it completes are kept
                    self._rewrite_only = False
                    start = buf.tell()
                else:
                    owner, start = self._line_starts.get(key, (None, 0))
                    if owner is not buf:
                        start = 0
                buf.seek(start)
                buf.truncate()
                buf.write(string[p:])
                self._line_starts[key] = (buf, start)
            self._schedule_flush()
            return len(string)

        write = interrupts_at_users_line(write, __file__)  # Ctrl-C in a print ends at the user's line

        @property
        def _line_starts(self) -> dict:
            starts = self.__dict__.get("_clorch_line_starts")
            if starts is None:
                starts = self.__dict__["_clorch_line_starts"] = {}
            return starts

        def _flush(self) -> None:
            super()._flush()
            self._last_send = time.monotonic()
            self._rewrite_only = True

        def flush(self) -> None:
            if self._clean:
                return
            if self._rewrite_only and _in_cell and time.monotonic() - self._last_send < COALESCE_S:
                return  # a timed flush is scheduled (every write schedules one)
            self._clean = True
            thread = self.pub_thread
            if (thread is None or thread.thread is None or not thread.thread.is_alive()
                    or thread.thread.ident == threading.get_ident()):
                super().flush()  # ipykernel sends at once in these cases
                return
            # ipykernel's flush waits until the IOPub thread has taken the text from the buffer,
            # but the send itself is queued behind that, for the thread's next round: a cell that
            # then holds the GIL in native code (``print('x', flush=True); sum(range(10**11))``)
            # kept its flushed output from the notebook until it let go. Wait for that round
            # too: the thread runs it on its own, so this costs no extra wake-up.
            done = threading.Event()
            thread.schedule(self._flush)
            thread.schedule(lambda: thread.schedule(done.set))
            if not done.wait(self.flush_timeout):
                print("IOStream.flush timed out", file=sys.__stderr__)

    return RankOutStream


def _kernel_class() -> type:
    from ipykernel import ipkernel
    from ipykernel.ipkernel import IPythonKernel
    from zmq.eventloop.zmqstream import ZMQStream

    _memoize_accepts_parameters(ipkernel)

    class RankKernel(StdinPolicy, IPythonKernel):
        """ipykernel's kernel, marking when a cell runs (for RankOutStream) and writing a failed
        cell's traceback into the rank's log, where ipykernel writes only the iopub message."""

        @property
        def _supports_kernel_subshells(self) -> bool:
            return bool(self.shell_channel_thread)  # False with _NoShellChannelThread

        def _publish_status(self, status, channel, parent=None):  # type: ignore[no-untyped-def]
            """No busy/idle on iopub for the notebook's probes (the hang check, ``%clorch top``
            once a second): nothing reads them, and published from the control thread while the
            main thread's cell output went out they arrived split in two at the relay (seen with
            a probe every 0.2 s: the status's frames, then its delimiter alone)."""
            header = ((parent or self.get_parent(channel)) or {}).get("header") or {}
            if header.get("msg_type") == _PROBE_REQUEST:
                return
            super()._publish_status(status, channel, parent)

        def __init__(self, **kwargs):  # type: ignore[no-untyped-def]
            super().__init__(**kwargs)
            from . import rank_debug

            rank_debug.install()  # after ipykernel imported debugpy, which replaces the hook
            #: (msg_id, one entry per iopub message sent for it) while a lean request runs
            self._counting: tuple[str, list[None]] | None = None
            self._count_iopub()
            log_displays(self)

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
            from jupyter_client.session import extract_header

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
            queue. Kept, in ipykernel's order: the parent (output, prompts and comms belong to
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
                self.log.error("KeyboardInterrupt caught in kernel.")
            finally:
                self._counting = None
                try:
                    self.post_handler_hook()
                except Exception:  # noqa: BLE001 - as ipykernel
                    self.log.debug("Unable to signal in post_handler_hook:", exc_info=True)
            if sys.stdout is not None:
                sys.stdout.flush()
            if sys.stderr is not None:
                sys.stderr.flush()
            if replied:
                if isinstance(stream, ZMQStream) and stream.sending():
                    stream.flush()  # the reply went through the stream's queue: send it now
            elif isinstance(stream, ZMQStream) and not stream.sending():
                self._publish_status("idle", "shell")  # no reply: the idle ends the relay's wait
            else:
                self._publish_status_and_flush("idle", "shell", stream)

        async def _lean_execute_request(self, stream, idents: list[bytes], parent: dict) -> bool:  # type: ignore[no-untyped-def]
            """Run the request and reply, with the count of its iopub messages; True once replied."""
            from ipykernel.jsonutil import json_clean

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
            metadata = self.init_metadata(parent)
            self._next_limits = Limits.from_wire(cell_meta.get(OUTPUT_LIMITS_KEY))
            if not silent:
                self.execution_count += 1  # what ipykernel does (IPythonKernel counts in its shell)
                number = cell_meta.get(CELL_NUMBER_KEY)
                if isinstance(number, int) and not isinstance(number, bool) and number >= 0:
                    self.shell.execution_count = number  # the notebook's [n] (wire.CELL_NUMBER_KEY)
            reply_content = await self.do_execute(**args)
            if sys.stdout is not None:
                sys.stdout.flush()
            if sys.stderr is not None:
                sys.stderr.flush()
            if self._execute_sleep:
                time.sleep(self._execute_sleep)
            reply_content = json_clean(reply_content)
            metadata = self.finish_metadata(parent, metadata, reply_content)
            if self._counting is not None:  # everything the cell sent is counted: the streams are flushed
                metadata[IOPUB_COUNT_KEY] = len(self._counting[1])
            if isinstance(stream, ZMQStream) and not stream.sending():
                stream = stream.socket  # this thread's own socket, nothing queued before: send now
            self.session.send(stream, "execute_reply", reply_content, parent, metadata=metadata, ident=idents)
            if not silent and reply_content["status"] == "error" and content.get("stop_on_error", True):
                self._abort_queues(None)
            return True

        async def do_execute(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            global _in_cell
            limits, self._next_limits = getattr(self, "_next_limits", None), None
            silent = bool(kwargs.get("silent", args[1] if len(args) > 1 else False))
            _start_budget(limits or Limits(), silent)
            _in_cell = True
            transform = _TransformOnce(self.shell)
            try:
                reply = await super().do_execute(*args, **kwargs)
            finally:
                _in_cell = False
                transform.close()
                _publish_held_back()
            if isinstance(reply, dict) and reply.get("status") == "error":
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    text = "\n".join(reply.get("traceback") or [f"{reply.get('ename')}: {reply.get('evalue')}"])
                    sys.__stderr__.write(text + "\n")
                    sys.__stderr__.flush()
                except (OSError, ValueError) as exc:  # the log is gone: nothing to write it to
                    self.log.debug("could not write the traceback to the rank's log: %s", exc)
            return reply

    return RankKernel


def _memoize_accepts_parameters(ipkernel: types.ModuleType) -> None:
    """ipykernel asks ``inspect.signature`` of IPython's run_cell, every cell, which keyword
    arguments it takes (about 30 us of a rank's CPU per cell): remember the answer per function.
    An ipykernel without the helper is left as it is."""
    ask = getattr(ipkernel, "_accepts_parameters", None)
    if ask is None or getattr(ask, "_clorch_memo", False):
        return
    answers: dict[tuple, dict] = {}

    def accepts_parameters(meth, param_names):  # type: ignore[no-untyped-def]
        key = (getattr(meth, "__func__", meth), tuple(param_names))
        try:
            answer = answers[key]
        except KeyError:
            answer = answers[key] = ask(meth, param_names)
        except TypeError:  # unhashable: ask every time
            return ask(meth, param_names)
        return dict(answer)

    accepts_parameters._clorch_memo = True  # type: ignore[attr-defined]
    ipkernel._accepts_parameters = accepts_parameters


class _TransformOnce:
    """ipykernel's do_execute transforms the cell's code (``shell.transform_cell``) to decide how
    to run it, then IPython's run_cell transforms the same code again, with nothing run in
    between: the second call gets the first one's result (about 80 us of a rank's CPU per cell).
    Only that once: the shell's own method is back (and any later call computes afresh) as soon
    as it was reused or the cell ends."""

    def __init__(self, shell) -> None:  # type: ignore[no-untyped-def]
        self.shell = shell
        self.memo: tuple[str, str] | None = None
        if shell is not None and "transform_cell" not in vars(shell):
            shell.transform_cell = self
        else:
            self.shell = None

    def __call__(self, raw_cell: str) -> str:
        memo, self.memo = self.memo, None
        if memo is not None and memo[0] == raw_cell:
            self.close()
            return memo[1]
        cell = type(self.shell).transform_cell(self.shell, raw_cell)
        self.memo = (raw_cell, cell)
        return cell

    def close(self) -> None:
        if self.shell is not None:
            if vars(self.shell).get("transform_cell") is self:
                del self.shell.transform_cell
            self.shell = None


class _NoShellChannelThread:
    """Stands in for ipykernel's shell channel thread, which a rank does without (see the module
    docstring). Falsy, so that ipykernel takes its path for a kernel without one everywhere it
    asks (``if self.shell_channel_thread``; RankKernel's ``_supports_kernel_subshells``), and
    with ``parent_thread``, which ipykernel 7.4 still reads to run top-level-await cells on the
    main thread with Ctrl-C support, where None would raise AttributeError."""

    def __init__(self) -> None:
        self.parent_thread = threading.main_thread()

    def __bool__(self) -> bool:
        return False


def _app_class() -> type:
    from ipykernel.kernelapp import IPKernelApp

    class RankKernelApp(IPKernelApp):
        """No start-up banner in the rank's log: "To connect another client..." and the note on
        Ctrl-C are ipykernel talking to a terminal user, and the log is the rank's output."""

        def init_sockets(self) -> None:
            super().init_sockets()
            thread = getattr(self, "shell_channel_thread", None)
            if thread is not None:  # made, not started: see the module docstring
                thread.io_loop.close()
                self.shell_channel_thread = _NoShellChannelThread()

        def log_connection_info(self) -> None:
            self.log.debug("connection file: %s", self.connection_file)
            self._ports = dict(shell=self.shell_port, iopub=self.iopub_port, stdin=self.stdin_port,
                               hb=self.hb_port, control=self.control_port)

    return RankKernelApp


_BUILDERS = {"RankOutStream": _out_stream_class, "RankKernel": _kernel_class, "RankKernelApp": _app_class}


def __getattr__(name: str) -> type:
    # Built on first use: importing ipykernel here at module level would slow every import of
    # clorch_repl.session in the notebook's own process.
    if name in _BUILDERS:
        cls = _BUILDERS[name]()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def warm_imports() -> None:
    """What a warm spare does before its kernel starts: import what joining a group imports
    (torch, torch.distributed, clorch's rendezvous and recorder), so that a restart does not wait
    for it. It touches no GPU: CUDA is initialised when the spare joins a group as a rank."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from .. import distributed, rendezvous  # noqa: F401
    from ..diagnosis import record  # noqa: F401
    from . import bootstrap, rank_kernel  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    from ..rank_env import SPARE_ENV

    numa.bind_rank()  # first: the watchdog thread below and the kernel's threads inherit the binding
    watch_parent(os.getppid(), end_own_group)  # the supervisor; see the module's docstring
    if os.environ.pop(SPARE_ENV, ""):
        warm_imports()
    # A segfault or abort prints the Python stacks into the rank's log (fd 2), whose tail the
    # notebook shows when a rank dies mid-cell.
    faulthandler.enable(file=sys.__stderr__, all_threads=False)  # the crashing thread: short
    stack_path = os.environ.get(STACK_FILE_ENV)
    if stack_path:
        stack_file = open(stack_path, "a", buffering=1)  # noqa: SIM115 - must outlive main()
        # The main thread only (Linux hands a process-directed signal to the main thread unless it
        # cannot take it right then; rankfiles.main_thread_stack drops such a dump): walking every thread from a signal handler reads other threads'
        # frames without the GIL and crashed a rank (SIGSEGV) when one of them changed under it
        # (seen in CI: a rank stuck in a gloo barrier, probed by `%clorch why`). The other threads'
        # stacks come from the probe, which reads them under the GIL.
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False, chain=False)

    args = list(sys.argv[1:] if argv is None else argv)
    __getattr__("RankKernelApp").launch_instance(argv=[*args, *KERNEL_OPTIONS])


if __name__ == "__main__":
    main()
