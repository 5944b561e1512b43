"""The rank's checkpoint writer process: it writes an asynchronous save's shards, so that the
Python of writing them (DCP's per-item ``torch.save``, its pickling and CRCs) runs on a GIL of
its own and not on the one the training steps need (:mod:`.host_arena` has the measurement).

What stays in the rank: DCP's planning and its collectives, the ``.metadata`` file, the commit
(:mod:`.sharded`). What moves here: only :meth:`StorageWriter.write_data`, the shard files, byte
for byte what DCP's ``FileSystemWriter`` writes (one file per rank, each tensor a ``torch.save``
record, each other value its bytes), so a checkpoint written this way loads with ``dcp.load``.

The two processes talk over a private socket pair made at the start (no name, no port; the child
inherits its end): length-prefixed pickles, since both ends are this package in this user's
processes, and the staging block's descriptor passed once per layout (``SCM_RIGHTS``). The
writer starts at a rank's first asynchronous save, serves every later one, and ends when the
rank's end of the socket closes, however the rank ends.
"""

from __future__ import annotations

import argparse
import io
import logging
import math
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["WriterProcess", "write_shard_file", "main"]

_HEADER = struct.Struct("!Q")
#: file descriptors one message may carry (the staging block's)
_MAX_FDS = 4

#: what the writer process runs. SIGINT ignored first: an interrupt of the rank's cell goes to its
#: whole process group, and must not cut a save in flight (the rank's own stop ends the writer by
#: its socket, or SIGTERM/SIGKILL to the group). The working directory is taken off the path (a
#: ``clorch_repl`` folder there must not shadow the install); the package's own root goes last,
#: for a rank that imports it from a path rather than an install.
_CHILD = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
          "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; sys.path.append(sys.argv.pop(1))\n"
          f"from {__name__} import main; sys.exit(main())")

#: one item of a shard file: ("t", offset in the block, dtype name, shape) for a staged tensor,
#: ("b", bytes) for bytes written as they are (DCP's BYTE_IO items, or a tensor saved in the rank)
Item = tuple


def _send(sock: socket.socket, message: Any, fds: list[int] | None = None) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    frame = _HEADER.pack(len(payload)) + payload
    if fds:
        sent = socket.send_fds(sock, [frame], fds)
        frame = frame[sent:]
    if frame:
        sock.sendall(frame)


def _receive(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next message and the descriptors that came with it; None at the end of the stream."""
    fds: list[int] = []

    def exactly(size: int) -> bytes | None:
        chunks, got = [], 0
        while got < size:
            data, new_fds, _flags, _addr = socket.recv_fds(sock, size - got, _MAX_FDS)
            fds.extend(new_fds)
            if not data:
                return None
            chunks.append(data)
            got += len(data)
        return b"".join(chunks)

    header = exactly(_HEADER.size)
    if header is None:
        return None
    payload = exactly(_HEADER.unpack(header)[0])
    if payload is None:
        return None
    return pickle.loads(payload), fds


# -- the rank's side -------------------------------------------------------------------------------

class WriterProcess:
    """The rank's handle on its writer process, started on first use and again if it ended."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._arena_sent: weakref.ref | None = None
        self._lock = threading.Lock()

    def write(self, path: str, items: list[Item], arena: Any, fsync: bool) -> list[tuple[int, int]]:
        """Write one shard file at ``path``; returns each item's (offset, length) in it.

        Raises :class:`~clorch_repl.errors.CheckpointError` with the writer's reason, or its exit
        code if it ended meanwhile."""
        from ...errors import CheckpointError

        with self._lock:
            sock = self._started()
            try:
                if self._arena_sent is None or self._arena_sent() is not arena:
                    _send(sock, ("arena", id(arena), arena.nbytes), [arena.fd])
                    self._arena_sent = weakref.ref(arena)
                _send(sock, ("write", path, items, fsync, id(arena)))
                reply = _receive(sock)
            except OSError:  # the writer ended between the check and the send (a broken pipe)
                reply = None
            if reply is None:
                code = self._ended()
                raise CheckpointError(f"the checkpoint writer process ended (exit code {code}) while writing {path}; "
                                      "the previous checkpoint is untouched: save again (the writer restarts)")
            status, value = reply[0]
            if status != "ok":
                raise CheckpointError(f"writing {path} failed: {value}")
            return value

    def forget_block(self) -> None:
        """Have the writer unmap the staging block it was given: the rank is about to make another
        (a changed layout), and the old one's memory must go first, not at the next write."""
        with self._lock:
            if self._sock is not None and self._arena_sent is not None:
                try:
                    _send(self._sock, ("drop",))
                except OSError:  # an ended writer holds nothing; the next write starts another
                    logger.debug("the checkpoint writer had ended before its block was dropped")
                self._arena_sent = None

    def close(self) -> None:
        """End the writer: it finishes nothing more and exits at the closed socket. A write in
        flight is cut (its reply never read), so a rank that ends does not wait for it."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # without the lock a write in flight holds
            except OSError:
                logger.debug("the checkpoint writer's socket was already closed")
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._proc is not None:
                try:
                    self._proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    logger.warning("the checkpoint writer process %d did not end in 10 s: killing it", self._proc.pid)
                    self._proc.kill()
                    self._proc.wait()
                self._proc = None

    def _started(self) -> socket.socket:
        if self._sock is not None and self._proc is not None and self._proc.poll() is None:
            return self._sock
        self._ended()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        try:
            # Not ``-m``: the package imports this module before runpy would run it as __main__.
            self._proc = subprocess.Popen([sys.executable, "-c", _CHILD, package_root, "--fd", str(theirs.fileno())],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self._sock, self._arena_sent = ours, None
        logger.debug("checkpoint writer process %d started", self._proc.pid)
        return ours

    def _ended(self) -> int | None:
        """Forget an ended (or never started) writer; its exit code."""
        code = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._proc is not None:
            try:
                code = self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            self._proc = None
        return code


# -- the writer's side -----------------------------------------------------------------------------

def write_shard_file(path: str, items: list[Item], block: Any, fsync: bool) -> list[tuple[int, int]]:
    """Write ``items`` to a new file at ``path`` as DCP's FileSystemWriter does; their spans."""
    import torch

    spans = []
    with open(path, "wb") as stream:
        for item in items:
            offset = stream.tell()
            if item[0] == "t":
                _kind, start, dtype_name, shape = item
                dtype = getattr(torch, dtype_name)
                tensor = torch.frombuffer(block, dtype=dtype, count=math.prod(shape), offset=start).view(shape)
                torch.save(tensor, stream)  # a storage of exactly this tensor's elements, as DCP saves it
            else:
                stream.write(item[1])
            spans.append((offset, stream.tell() - offset))
        stream.flush()
        if fsync:
            os.fsync(stream.fileno())
    return spans


def tensor_bytes(tensor: Any) -> bytes:
    """A tensor that is not in the staging block, as DCP would write it (a compact copy)."""
    import torch

    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        tensor = tensor.clone()
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


def serve(sock: socket.socket) -> int:
    """Answer the rank's requests until it closes the socket."""
    blocks: dict[int, mmap.mmap] = {}
    while True:
        received = _receive(sock)
        if received is None:
            return 0
        message, fds = received
        if message[0] == "drop":
            blocks.clear()
            continue
        if message[0] == "arena":
            _kind, arena_id, size = message
            blocks.clear()  # a new layout: the old block is no longer staged into
            blocks[arena_id] = mmap.mmap(fds[0], size)
            for fd in fds:
                os.close(fd)
            continue
        _kind, path, items, fsync, arena_id = message
        try:
            reply = ("ok", write_shard_file(path, items, blocks.get(arena_id), fsync))
        except Exception as exc:  # noqa: BLE001 - the rank raises it as a CheckpointError on every rank
            logger.debug("writing %s failed", path, exc_info=True)
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            _send(sock, reply)
        except OSError:  # the rank ended while this file was written: nobody is left to tell
            logger.warning("the rank ended while %s was written; the save it belonged to was never committed", path)
            return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a rank's checkpoint writer (started by the rank itself)")
    parser.add_argument("--fd", type=int, required=True, help="this process's end of the rank's socket pair")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="clorch checkpoint writer: %(message)s")
    with socket.socket(fileno=args.fd) as sock:
        return serve(sock)

