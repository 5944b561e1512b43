"""The rendezvous store, bound to loopback.

torch's TCPStore server listens on every interface (``::``) whatever MASTER_ADDR says, which would
expose rank 0 of a notebook session to the network. Rank 0 here binds the listening socket itself,
on MASTER_ADDR (127.0.0.1 as our launchers set it), and hands it to the store.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings

import torch.distributed as dist


def loopback_store(rank: int, world_size: int, timeout: datetime.timedelta, addr: str | None = None,
                   port: int | None = None) -> dist.Store:
    """The store of the default group (at MASTER_ADDR/MASTER_PORT unless given); rank 0 serves it."""
    addr = addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = port if port is not None else int(os.environ["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(addr, port, world_size, False, timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, port))
    sock.listen(max(64, 2 * world_size))
    try:
        # detach: the store owns the descriptor from here on, and closes it.
        return dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach(), use_libuv=True)
    except (TypeError, RuntimeError) as exc:
        # torch without master_listen_fd: its own server (on every interface) is what remains.
        sock.close()
        warnings.warn(f"clorch_repl: this torch cannot serve the rendezvous store on a socket bound to "
                      f"{addr} ({exc}); torch's own store listens on every interface of this host",
                      RuntimeWarning, stacklevel=2)
        return dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False)


def loopback_socket_env() -> dict[str, str]:
    """Keep gloo's and NCCL's own bootstrap sockets on loopback (one host; users may override)."""
    return {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
