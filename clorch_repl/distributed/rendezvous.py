"""The rendezvous store of a process group: private to this user where the ranks share a host.

**Local ranks (a notebook session, ``launch()``):** the store is a torch ``FileStore`` in the
session's or job's private directory (0700, made by ``mkdtemp``), named by ``CLORCH_STORE_FILE``.
Only this user (and root) can open it: another local user can neither list, read nor write the
group's keys, so cannot steer a later ``dist.new_group`` either (a TCPStore on loopback was open
to every user of the host, and an overwritten key broke the owner's next ``new_group``). A fresh
file is used for every start, so a restart never reads a previous group's keys. FileStore works
for gloo and NCCL alike, for the default group and for every later ``new_group`` (which keeps
its keys under a prefix in the same store). The file itself is made 0600 before torch opens it
(:func:`private_file`): torch's ``FileStore`` would create it under the rank's umask (0644), so
that the folder's mode alone kept the group's keys from other users.

**What this does not protect.** The backends' own data sockets are not authenticated: gloo's
pairs and NCCL's bootstrap and socket transport listen on TCP, kept on loopback here
(``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=lo``, set by :mod:`clorch_repl.wire.rank_env`), so the network
cannot reach them, but another local user who finds their ports can connect to them and disturb
(or feed data into) a collective. Their addresses are only published through the store, which
such a user can no longer read. The ranks' kernel channels are IPC sockets in the private
directory and every message is HMAC-signed (see :mod:`clorch_repl.launchers.local`).

**Remote ranks (several hosts):** a FileStore needs a shared filesystem, so ranks on other hosts
rendezvous through :func:`loopback_store`'s TCPStore at MASTER_ADDR:MASTER_PORT, which has no
authentication: anyone who can reach that port (every local user of the master host, and the
network between the hosts) can read and write the group's keys. Keep such ports on a private
network. torch's TCPStore server also listens on every interface whatever MASTER_ADDR says; rank 0
here binds the listening socket itself, on MASTER_ADDR, and hands it to the store.
"""

from __future__ import annotations

import datetime
import os
import socket
import warnings

import torch.distributed as dist

from ..wire.rank_env import STORE_FILE_ENV


def private_file(path: str) -> None:
    """Create ``path`` readable and writable by this user alone, unless it exists (then it is left
    as it is: another rank of the group made it first, or torch is using it). Empty is what torch's
    FileStore takes as a store with no keys."""
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600))


def loopback_store(rank: int, world_size: int, timeout: datetime.timedelta, addr: str | None = None,
                   port: int | None = None) -> dist.Store:
    """The store of the default group: the private FileStore named by ``CLORCH_STORE_FILE`` when
    our launcher set one (and ``port``, if given, is the launcher's MASTER_PORT), else a TCPStore
    at MASTER_ADDR/MASTER_PORT (unless given) that rank 0 serves on that address only."""
    store_file = os.environ.get(STORE_FILE_ENV)
    env_port = os.environ.get("MASTER_PORT")
    if store_file and (port is None or (env_port is not None and str(port) == env_port)):
        private_file(store_file)
        store = dist.FileStore(store_file, world_size)
        store.set_timeout(timeout)
        return store
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
