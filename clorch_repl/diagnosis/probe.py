"""What a rank answers when asked "where are you", and how the notebook asks every rank at once.

The answer is built on the rank's kernel control thread (see
:mod:`clorch_repl.kernel.probes`), so it comes while the main thread is blocked
in a collective or in native code that released the GIL. It holds the flight-recorder entries, the
main thread's Python stack cut to the cell's frames, the process groups, and whether a CUDA stream
is still busy. It travels over the rank's own control channel, signed like every message, so it
works wherever the rank runs.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
import uuid
from typing import Any

import zmq

from ..common.cell_boundary import calls_the_cell
from ..common.imported import imported
from ..common.package_files import PACKAGE_DIR, is_package_file
from ..wire.probe import PROBE_REPLY, PROBE_REQUEST, ProbeRequest
from . import record

logger = logging.getLogger(__name__)

#: How long the notebook waits for every rank's answer. A rank's control thread answers within
#: milliseconds unless native code holds the GIL; then the faulthandler stack stands in for it.
PROBE_TIMEOUT_S = 3.0
#: Entries of the flight recorder sent back (the most recent); enough to line up the ranks.
ENTRIES_SENT = 200

_LIBRARY_DIRS = tuple({os.path.realpath(p) for p in (
    sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib"),
    sysconfig.get_paths().get("platlib"), PACKAGE_DIR.rstrip(os.sep)) if p})


# ------------------------------------------------------------------------------- rank side
def answer(request: ProbeRequest) -> dict[str, Any]:
    """This rank's state, as plain JSON data (called on the control thread, never the main one).

    ``request.light``: the flight recorder's group status without its entries (the notebook's
    periodic hang check; see :func:`record.read`)."""
    fr, fr_missing = record.read(collectives=not request.light)
    if fr is not None:
        fr["entries"] = recent(fr["entries"], ENTRIES_SENT)
    main = threading.main_thread()
    frames = sys._current_frames()
    main_frame = frames.get(main.ident) if main.ident is not None else None
    stack, in_cell = (cell_frames(main_frame) if main_frame is not None else ([], False))
    reply: dict[str, Any] = {
        "pid": os.getpid(), "host": os.uname().nodename, "now_ns": time.time_ns(),
        "fr": fr, "fr_missing": fr_missing, "groups": record.group_members(),
        "stack": stack, "in_cell": in_cell, "cuda_busy": cuda_busy(), "saves": saves_in_flight(),
        "cell_began_ns": _cell_began_ns(),
    }
    if request.usage:  # %clorch top: what the rank uses now (clorch_repl.diagnosis.usage)
        from .usage import usage

        reply["usage"] = usage()
    if request.all_threads:
        names = {t.ident: t.name for t in threading.enumerate()}
        reply["threads"] = [{"name": names.get(ident, str(ident)), "stack": _frames(frame)}
                            for ident, frame in frames.items() if ident != main.ident]
    return reply


def saves_in_flight() -> list[dict[str, Any]]:
    """This rank's asynchronous checkpoint save still writing (path, seconds); read only where the
    checkpoint package is already imported, so a probe never imports it (or torch's DCP) itself."""
    module = sys.modules.get("clorch_repl.training.checkpoint.in_flight")
    return module.in_flight() if module is not None else []


def recent(entries: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """The last ``keep`` entries of each process group of each recorder, in their order: a busy
    group (a second group's loop, a thread's collectives) must not push another group's pending
    collective out of the answer, nor a busy NCCL buffer a gloo group's."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for entry in reversed(entries):
        key = (str(entry.get("recorder")), str(entry.get("pg_id")))
        if seen.get(key, 0) < keep:
            seen[key] = seen.get(key, 0) + 1
            out.append(entry)
    out.reverse()
    return out


def _frames(frame: Any) -> list[dict[str, Any]]:
    """A frame chain as dicts, outermost first, each labelled as the notebook labels it."""
    label_of = _cell_labeller()
    out = []
    for summary in traceback.extract_stack(frame):
        cell = label_of(summary.filename)
        own = is_own(summary.filename)
        out.append({"file": summary.filename, "line": summary.lineno, "function": summary.name,
                    "code": (summary.line or "").strip(), "cell": cell,
                    "library": own or (cell is None and is_library(summary.filename)), "own": own})
    return out


def cell_frames(frame: Any) -> tuple[list[dict[str, Any]], bool]:
    """The main thread's stack from the cell's code inwards, and whether a cell is running at all.

    Cut where IPython calls the cell (:mod:`clorch_repl.common.cell_boundary`, as the stuck-rank report
    does): what lies outside is the same kernel machinery on every rank.
    """
    frames = _frames(frame)
    for i in range(len(frames) - 1, -1, -1):
        f = frames[i]
        if calls_the_cell(f["file"], f["function"]):
            return frames[i + 1:], True
    # No cell on the stack: a kernel between cells, or a plain program (a launch() rank), which
    # is always "running its cell"; or a top-level-await cell suspended in its await (its frames
    # are off the stack while the event loop waits), which the rank's kernel still marks as running.
    return frames, not _in_kernel() or _executing()


def _executing() -> bool:
    """Whether the rank's kernel is inside a cell's do_execute (clorch_repl.kernel.output; not
    imported here: a process without it is no rank's kernel)."""
    output = sys.modules.get("clorch_repl.kernel.output")
    return output is not None and output.in_cell()


def _cell_began_ns() -> int | None:
    """When the rank's latest cell began (clorch_repl.kernel.output, as :func:`_executing` asks it)."""
    output = sys.modules.get("clorch_repl.kernel.output")
    return output.cell_began_ns() if output is not None else None


def _in_kernel() -> bool:
    if "ipykernel" not in sys.modules:
        return False
    from IPython.core.getipython import get_ipython

    return get_ipython() is not None


def _cell_labeller() -> Any:
    """``Cell In[5]`` for a cell's compiled file name, as IPython's tracebacks name it."""
    try:
        from IPython.core.getipython import get_ipython

        shell = get_ipython()
        fmt = shell.compile.format_code_name if shell is not None else None
    except (ImportError, AttributeError):
        fmt = None

    def label(filename: str) -> str | None:
        if fmt is None:
            return None
        try:
            named = fmt(filename)
        except (KeyError, TypeError, AttributeError):
            return None
        return f"{named[0]} {named[1]}" if named else None
    return label


def is_library(filename: str) -> bool:
    """Frames of Python itself, installed packages and clorch_repl: not the user's code."""
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    path = os.path.realpath(filename)
    return any(path.startswith(d + os.sep) for d in _LIBRARY_DIRS)


def is_own(filename: str) -> bool:
    """Frames of clorch_repl itself (the frame's code file inside this package, or the cell of one
    of clorch's requests, such as ``%clorch run``'s: :func:`clorch_repl.kernel.requests.is_request_cell`):
    what every report leaves out of a stack (:func:`clorch_repl.diagnosis.where.own_frame` reads
    this mark). Decided here, on the rank, because only the rank knows where its package lies (a
    remote host's install is not the notebook's) and which of its cells were requests, and by the
    file, never by the text shown for it (:mod:`clorch_repl.common.package_files`)."""
    return is_package_file(filename) or _request_cell(filename)


def _request_cell(filename: str) -> bool:
    """Whether ``filename`` is a request's cell; read only where the request registry is already
    imported (a process that never ran a request has none, and a probe imports nothing)."""
    requests = sys.modules.get("clorch_repl.kernel.requests")
    return requests is not None and requests.is_request_cell(filename)


def cuda_busy() -> bool | None:
    """Whether the current CUDA stream of this rank's own GPU still has work queued; None when
    CUDA was never initialised here (asking must not create a context), or torch's import has
    not finished (common.imported: touching a half-built torch can crash the rank)."""
    torch = imported("torch")
    if torch is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        from ..wire.rank_env import device_index

        # The rank's own GPU, named: the probe runs on a thread of its own, whose current device is
        # cuda:0 whatever the main thread set (CUDA's current device is per thread), and a rank
        # sees its host's GPUs (cuda:{LOCAL_RANK} is its own).
        index = device_index(os.environ)
        return not torch.cuda.current_stream(index if index is not None else None).query()
    except RuntimeError as exc:
        logger.debug("could not query the CUDA stream: %s", exc)
        return None


# --------------------------------------------------------------------------- notebook side
class Prober:
    """Asks ranks over their control channels; one DEALER socket per rank, opened once."""

    def __init__(self) -> None:
        self._ranks: dict[int, tuple[Any, Any, Any]] = {}  # rank -> (socket, session, decoder)
        self._poller = zmq.Poller()

    def add(self, rank: int, client: Any, decoder: Any) -> None:
        """``client`` is the rank's jupyter_client client; ``decoder`` verifies its signatures."""
        socket = client.connect_control(identity=f"clorch-probe-{uuid.uuid4().hex}".encode())
        self._poller.register(socket, zmq.POLLIN)
        self._ranks[rank] = (socket, client.session, decoder)

    def remove(self, rank: int) -> None:
        """Forget ``rank`` (its process is being replaced); its socket is closed."""
        entry = self._ranks.pop(rank, None)
        if entry is not None:
            try:
                self._poller.unregister(entry[0])
            except KeyError:
                pass
            entry[0].close(linger=0)

    def ask(self, ranks: list[int], *, all_threads: bool = False, light: bool = False, usage: bool = False,
            abort: bool = False, timeout_s: float = PROBE_TIMEOUT_S) -> dict[int, dict[str, Any] | None]:
        """Every rank's answer; None for a rank that did not answer within ``timeout_s``.
        ``light``: the flight recorder's group status, not its entries (see :func:`answer`);
        ``usage``: the rank's CPU, memory and GPU figures too (``%clorch top``); ``abort``: no
        question but an order, to abort the rank's groups (kernel.regroup.abort), and its report."""
        waiting = self.send(ranks, all_threads=all_threads, light=light, usage=usage, abort=abort)
        asked = dict(waiting)
        answers: dict[int, dict[str, Any] | None] = {r: None for r in ranks}
        answers.update({asked[msg_id]: answer for msg_id, answer in self.collect(waiting, timeout_s).items()})
        return answers

    def send(self, ranks: list[int], *, all_threads: bool = False, light: bool = False,
             usage: bool = False, abort: bool = False) -> dict[str, int]:
        """Ask without waiting; returns msg_id -> rank, for :meth:`collect` (``%clorch top`` asks
        from the relay's loop, which must not wait for a rank that holds its GIL)."""
        waiting: dict[str, int] = {}
        for rank in ranks:
            if rank not in self._ranks:
                continue
            socket, session, _ = self._ranks[rank]
            msg = session.msg(PROBE_REQUEST, ProbeRequest(all_threads=all_threads, light=light, usage=usage,
                                                          abort=abort).content())
            session.send(socket, msg)
            waiting[msg["header"]["msg_id"]] = rank
        return waiting

    def collect(self, waiting: dict[str, int], timeout_s: float = 0.0) -> dict[str, dict[str, Any]]:
        """msg_id -> answer of :meth:`send`'s questions that arrive within ``timeout_s`` (0: those
        here now); each found one is removed from ``waiting``. Replies to questions not in
        ``waiting`` are stale and dropped: one ``waiting`` must hold every question still open."""
        answers: dict[str, dict[str, Any]] = {}
        by_socket = {entry[0]: rank for rank, entry in self._ranks.items()}
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            ready = self._poller.poll(max(0, int(left * 1000) + 1) if left > 0 else 0)
            for socket, _ in ready:
                rank = by_socket[socket]
                while True:
                    try:
                        frames = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    try:
                        msg = self._ranks[rank][2].decode(frames)
                    except ValueError as exc:  # SignatureError: not from the rank; never trusted
                        logger.warning("dropped a control message from rank %d: %s", rank, exc)
                        continue
                    msg_id = msg["parent_header"].get("msg_id")
                    if msg["msg_type"] == PROBE_REPLY and waiting.get(msg_id) == rank:
                        del waiting[msg_id]
                        answers[msg_id] = msg["content"]
                    # else: the reply to an earlier probe that timed out; stale
            if left <= 0 or not ready and time.monotonic() >= deadline:
                break
        return answers

    def close(self) -> None:
        for socket, _, _ in self._ranks.values():
            try:
                self._poller.unregister(socket)
            except KeyError:
                pass
            socket.close(linger=0)
        self._ranks.clear()
