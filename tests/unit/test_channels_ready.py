"""Channels' wait for fresh ranks (recovery.replace) beside ranks that keep running: a survivor's
output that arrives meanwhile is left for the relay, not read and dropped (it raised KeyError),
and the relay's read loop finds it afterwards (a survivor's iopub is not in the sweep).

The jupyter_client clients are stand-ins here (a channel over a real ZeroMQ PAIR socket): the wait
only reads their sockets and asks ``kernel_info``; starting real kernels is what the integration
tests do (tests/integration/test_recover.py)."""

from __future__ import annotations

from queue import Empty
from typing import Any

import zmq

from clorch_repl.session.channels import KINDS, Channels


class _Channel:
    def __init__(self, ctx: zmq.Context, name: str) -> None:
        self.socket = ctx.socket(zmq.PAIR)
        self.peer = ctx.socket(zmq.PAIR)
        self.socket.bind(f"inproc://{name}")
        self.peer.connect(f"inproc://{name}")

    def get_msg(self, timeout: float = 0) -> Any:
        if not self.socket.poll(0):
            raise Empty
        return self.socket.recv_multipart()


class _Client:
    """A rank's channels; its kernel answers ``kernel_info`` on shell and iopub at once."""

    def __init__(self, ctx: zmq.Context, rank: int) -> None:
        for kind in KINDS:
            setattr(self, f"{kind}_channel", _Channel(ctx, f"rank{rank}-{kind}"))

    def kernel_info(self) -> None:
        self.shell_channel.peer.send(b"kernel_info_reply")
        self.iopub_channel.peer.send(b"status")


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank, self.alive = rank, True


class _Group:
    ranks = [_Rank(0), _Rank(1)]


def test_a_survivors_output_while_a_fresh_rank_starts_is_left_for_the_relay() -> None:
    ctx = zmq.Context()
    channels = Channels(_Group())  # type: ignore[arg-type]
    try:
        for rank in (0, 1):
            client = channels.clients[rank] = _Client(ctx, rank)  # type: ignore[assignment]
            channels._register(rank, client)  # as connect registers a rank's sockets
        channels.ready.poll(0)
        survivor = channels.clients[0].iopub_channel  # type: ignore[attr-defined]
        survivor.peer.send(b"rank 0's output, written as rank 1 restarts")
        progress: list[tuple[int, int]] = []
        channels._await_ready({1: set()}, lambda ready, total: progress.append((ready, total)), 5.0, None)
        assert progress[-1] == (1, 1)
        # the relay's next read asks the survivor's socket: its message signals no wake-up again
        assert survivor.socket in channels.ready.poll(1.0), "the survivor's output was stranded"
        assert survivor.socket.recv(zmq.NOBLOCK) == b"rank 0's output, written as rank 1 restarts"
        survivor.peer.send(b"and its next line")
        assert survivor.socket in channels.ready.poll(1.0)
        assert survivor.socket.recv(zmq.NOBLOCK) == b"and its next line"
    finally:
        channels.ready.close()
        ctx.destroy(linger=0)
