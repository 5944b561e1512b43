"""Ranks on other hosts, started by a launcher the cluster already runs, reached by messages only.

:class:`RemoteLauncher` is the common part of ``slurm`` and ``attach``: it opens the callback
endpoint (:mod:`.callback`), has the ranks started (the subclass's :meth:`~RemoteLauncher.begin`:
``srun``, or a command the user runs), waits for every rank to call back, decides the process
group's meeting point (rank 0's address and a port rank 0 chose on its host) and backend (NCCL
when every rank has a GPU, else gloo), and has each nanny start its rank's kernel. After that a
rank is a :class:`RemoteRank`: its kernel's channels (TCP on its host's address, CurveZMQ) and
what its nanny says. ``%clorch restart`` asks the same nannies for fresh kernels, inside the same
allocation; ``%clorch stop`` ends the kernels, then the nannies, then the launcher's own process.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any

from jupyter_client.session import Session as JupyterSession

from ..common import workdir
from ..common.atomic import remove_quietly
from ..errors import ClorchError, ConfigError
from ..wire.rank_env import host_gpu_lists
from ..common.rank_sets import rank_words
from ..common.topology import BACKENDS, Topology, remote_topology
from ..host import supervisor
from ..wire.nanny import ToNanny
from .base import LaunchOptions, Launcher, Progress, RankHandle
from .callback import (LOST_AFTER_S, CallbackServer, RemotePeer, connect_dir, connect_file_prefix,
                       default_listen_address, owned_prefix, remove_stale, remove_stale_connect_files)
from .spares import wanted_spares

logger = logging.getLogger(__name__)

#: How long each nanny gets to report its kernel's channels after being told to start it.
KERNEL_START_S = 120.0


class RemoteRank(RankHandle):
    """A rank on another host: its kernel's connection info and its nanny's word."""

    def __init__(self, server: CallbackServer, peer: RemotePeer) -> None:
        self.server = server
        self.peer = peer
        self.rank = peer.rank
        self.host = str(peer.hello.get("host", "?"))
        self.started_at = time.time()
        self._info = dict(peer.kernel or {})
        self._pid = self._info.pop("pid", None)

    def connection_info(self, session: bool = False) -> dict[str, Any]:
        info = {k: v for k, v in self._info.items() if k != "kernel_name"}
        if session:  # KernelManager.get_connection_info's shape: a Session instead of key and scheme
            key = str(info.pop("key")).encode()
            info["session"] = JupyterSession(key=key, signature_scheme=info.pop("signature_scheme", "hmac-sha256"))
            for name in ("curve_publickey", "curve_secretkey"):
                if isinstance(info.get(name), str):
                    info[name] = info[name].encode()
        return info

    @property
    def exit(self) -> str | None:
        if self.peer.exit is not None:
            return self.peer.exit
        if self.server.is_lost(self.rank):  # final (see clorch_repl.launchers.liveness)
            silent = self.peer.lost_after or self.server.silent_for(self.rank)
            return f"lost: no word from {self.host} for {silent:.0f} s (host down or link cut)"
        return None

    @property
    def pid(self) -> int | None:
        return self._pid if isinstance(self._pid, int) else None


class RemoteLauncher(Launcher):
    """The common part of launchers whose ranks call back (see the module docstring)."""

    def __init__(self, topology: Topology, options: LaunchOptions | None = None) -> None:
        super().__init__(topology, options)
        opts = self.options
        if opts.nproc_per_node is None:
            raise ConfigError(f"--launcher {self.name} needs --nproc-per-node: how many ranks to start on each "
                              "node (one per GPU on GPU nodes)")
        self.world_size = opts.nodes * opts.nproc_per_node
        # named with host and pid: a later start removes it if this notebook dies without a stop
        self.dir = tempfile.mkdtemp(prefix=owned_prefix("clorch"), dir=remove_stale(tempfile.gettempdir(), "clorch"))
        os.chmod(self.dir, 0o700)
        # in ~/.clorch (or $CLORCH_CONNECT_DIR): where the nodes can read it, unlike /tmp
        fd, self.connect_file = tempfile.mkstemp(prefix=connect_file_prefix(), suffix=".json",
                                                 dir=remove_stale_connect_files(connect_dir()))
        os.close(fd)
        try:
            listen = opts.listen or self.default_listen()
            self.server = CallbackServer(listen, opts.port, self.connect_file, self.world_size,
                                         opts.orphan_timeout_s)
        except BaseException:
            remove_quietly(self.connect_file)
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.ranks: list[RemoteRank] = []  # type: ignore[assignment]
        self._configured = False

    # -------------------------------------------------------------------- for subclasses
    def default_listen(self) -> str:
        """The address to listen on when --listen is not given."""
        return default_listen_address()

    def begin(self, progress: Progress) -> None:
        """Have the ranks started (once per session); they call back on their own."""
        raise NotImplementedError

    def still_coming(self) -> str | None:
        """Why no more ranks can come (the launcher's process ended), or None."""
        return None

    def end(self, lost: bool = False) -> None:
        """End what :meth:`begin` started (after the nannies were told to exit; ``lost``: some
        ranks could not hear that)."""

    # -------------------------------------------------------------------- the contract
    def launch(self, progress: Progress) -> None:
        workdir.working_directory()  # the ranks start in it: refused before the allocation, where it was deleted
        server = self.server
        if not self._configured:
            self.begin(progress)
            self._await_ranks(progress)
            self._configure()
            before = {r: 0 for r in range(self.world_size)}
            self._configure_send()
            self._configured = True
        else:  # a restart: fresh kernels from the same nannies, in the same allocation
            with server._lock:
                before = {r: p.kernel_generation for r, p in server.peers.items()}
                for peer in server.peers.values():
                    peer.exit, peer.death_report = None, ""
            for rank in range(self.world_size):
                server.send(rank, {"op": ToNanny.START_KERNEL})
        progress(f"{self.world_size} ranks called back; starting their kernels")
        self._await_kernels(list(range(self.world_size)), before)
        self.ranks = [RemoteRank(server, server.peers[r]) for r in range(self.world_size)]

    def _await_kernels(self, ranks: list[int], before: dict[int, int]) -> None:
        """Wait until each of ``ranks``' nannies reports a kernel newer than ``before`` said."""
        server = self.server

        def kernels_up() -> bool:
            return all(server.peers[r].kernel_generation > before[r] or server.peers[r].exit is not None
                       or server.silent_for(r) > LOST_AFTER_S for r in ranks)

        server.wait(kernels_up, KERNEL_START_S)
        failed = []
        for rank in ranks:
            peer = server.peers[rank]
            host = peer.hello.get("host")
            if peer.exit is not None:
                failed.append(f"rank {rank} on {host}: its kernel ended while starting ({peer.exit}); its log "
                              f"ends with:\n{peer.death_report}")
            elif server.silent_for(rank) > LOST_AFTER_S:
                failed.append(f"rank {rank} on {host}: lost (no word for {server.silent_for(rank):.0f} s); "
                              "%clorch stop, then start again on reachable nodes")
            elif peer.kernel_generation <= before[rank]:
                failed.append(f"rank {rank} on {host}: no kernel within {KERNEL_START_S:.0f} s")
        if failed:
            raise ClorchError("the ranks' kernels did not start:\n" + "\n".join(failed))

    def cannot_replace(self, ranks: list[int]) -> str:
        if 0 in ranks:
            return ("rank 0 serves the group's rendezvous store on its host, so it cannot be replaced alone: "
                    "%clorch restart starts every rank afresh")
        lost = [r for r in ranks if self.server.is_lost(r)]
        if lost:
            return (f"{rank_words(lost)} lost (no word from {'its' if len(lost) == 1 else 'their'} nanny): "
                    "%clorch stop, then start again on reachable nodes")
        return ""

    def replace(self, ranks: list[int], progress: Progress) -> None:
        """Fresh kernels for ``ranks`` from their own nannies, on their hosts (each nanny's warm
        spare where it keeps one), the others untouched. They meet the others through the group's
        rendezvous store, which rank 0's kernel serves on its host: rank 0 itself cannot be
        replaced so (``%clorch restart`` starts every rank afresh)."""
        server = self.server
        for rank in ranks:
            if self.ranks[rank].alive:
                server.request(rank, ToNanny.STOP_KERNEL, timeout_s=5.0, grace_s=1.0)
        with server._lock:
            before = {r: server.peers[r].kernel_generation for r in ranks}
            for rank in ranks:
                server.peers[rank].exit, server.peers[rank].death_report = None, ""
        for rank in ranks:
            server.send(rank, {"op": ToNanny.START_KERNEL})
        self._await_kernels(ranks, before)
        for rank in ranks:
            self.ranks[rank] = RemoteRank(server, server.peers[rank])
        progress(f"{len(ranks)} fresh rank(s) started by their nannies")

    def _await_ranks(self, progress: Progress) -> None:
        server, total = self.server, self.world_size
        deadline = time.monotonic() + self.options.start_timeout_s
        shown = -1
        while True:
            count, hosts, refused = server.snapshot()
            if count != shown:
                shown = count
                progress(f"ranks called back {count}/{total}" + (f" (hosts: {', '.join(hosts)})" if hosts else ""))
            if refused:
                raise ClorchError("a rank was refused: " + "; ".join(refused))
            if count == total:
                server.open_for_registration = False
                return
            gone = self.still_coming()
            if gone:
                raise ClorchError(f"{total - count} of {total} ranks never called back: {gone}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(total)) - set(server.peers))
                raise ClorchError(f"{rank_words(missing)} never called back within {self.options.start_timeout_s:.0f} s "
                                  f"(hosts seen: {', '.join(hosts) or 'none'}); check that the nodes can reach "
                                  f"{server.info.address}:{server.info.port} and read the connect file "
                                  f"{self.connect_file}")
            server.wait(lambda: len(server.peers) != count or bool(server.refused), 0.5)

    def _configure(self) -> None:
        """Decide the backend, devices and meeting point from what the ranks reported."""
        peers = [self.server.peers[r] for r in range(self.world_size)]
        gpus = []
        for peer in peers:
            visible = [str(g) for g in peer.hello.get("gpus") or []]
            local = int(peer.hello.get("local_rank", 0))
            if len(visible) == 1:  # the launcher gave each task its own GPU (srun --gpus-per-task=1)
                gpus.append(visible[0])
            else:
                gpus.append(visible[local] if local < len(visible) else None)
        # "" when the user gave no --backend: NCCL where every rank has a GPU, else gloo
        backend = self.topology.backend or ("nccl" if all(g is not None for g in gpus) else "gloo")
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        if backend == "nccl":
            lacking = [f"rank {p.rank} on {p.hello.get('host')}" for p, g in zip(peers, gpus) if g is None]
            if lacking:
                raise ClorchError(f"backend nccl needs one GPU per rank; {', '.join(lacking)} has none "
                                  "(fewer GPUs than --nproc-per-node on that node); use --backend gloo")
        else:
            if any(g is not None for g in gpus) and not self.topology.backend:
                lacking = [f"rank {p.rank} on {p.hello.get('host')}" for p, g in zip(peers, gpus) if g is None]
                logger.warning("clorch_repl: some ranks have GPUs but %s has none: every rank runs on the CPU with "
                               "gloo (more GPUs per node, or --backend gloo to say so)", ", ".join(lacking))
            gpus = [None] * len(peers)
        self._gpus = gpus
        # torchrun's convention: each rank sees its host's ranks' GPUs, its own at LOCAL_RANK
        self._host_gpus = host_gpu_lists([(str(p.hello.get("host")), int(p.hello.get("local_rank", 0)), g,
                                           [str(v) for v in p.hello.get("gpus") or []]) for p, g in zip(peers, gpus)])
        in_process = tuple(None if g is None else (listed.index(g) if listed else 0)
                           for g, listed in zip(gpus, self._host_gpus))
        self.topology = Topology(nproc=self.world_size,
                                 devices=tuple(int(g) if g is not None and g.isdigit() else None for g in gpus),
                                 backend=backend, timeout_s=self.topology.timeout_s,
                                 cpu_bind=self.topology.cpu_bind, in_process=in_process)

    def _configure_send(self) -> None:
        zero = self.server.peers[0].hello
        env = {k: os.environ[k] for k in ("PYTHONPATH",) if os.environ.get(k)}
        cwd = workdir.working_directory()
        for rank in range(self.world_size):
            self.server.send(rank, {"op": ToNanny.CONFIG, "master_addr": zero.get("address"),
                                    "master_port": zero.get("master_port"), "backend": self.topology.backend,
                                    "timeout_s": self.topology.timeout_s, "gpu": self._gpus[rank],
                                    "host_gpus": list(self._host_gpus[rank]),
                                    "cpu_bind": self.topology.cpu_bind, "cwd": cwd, "env": env})

    def interrupt(self, ranks: list[int] | None = None) -> None:
        for rank in range(self.world_size) if ranks is None else ranks:
            if rank in self.server.peers:
                self.server.send(rank, {"op": ToNanny.INTERRUPT})

    def dump_stack(self, rank: int) -> str:
        reply = self.server.request(rank, ToNanny.STACK, timeout_s=2.0)
        return str(reply.get("text", "")) if reply else ""

    def log_tail(self, rank: int, lines: int | None = 200) -> str:
        reply = self.server.request(rank, ToNanny.LOG, timeout_s=5.0, lines=lines)
        if reply is None:
            peer = self.server.peers.get(rank)
            host = peer.hello.get("host") if peer else "?"
            raise ClorchError(f"rank {rank} on {host} did not send its log within 5 s (host lost?)")
        return str(reply.get("text", ""))

    def death_report(self, rank: int, lines: int = 15) -> str:
        peer = self.server.peers.get(rank)
        if peer is None:
            return ""
        if peer.death_report:
            return "\n".join(peer.death_report.splitlines()[-lines:])
        return f"(no word from {peer.hello.get('host')}: its log stays there)"

    def group_formed(self) -> None:
        """Ask every nanny to keep a warm spare kernel for the next restart, where spares are
        wanted (``--spares``; by default for GPU ranks, as for the local launcher)."""
        if wanted_spares(self.topology, self.options.spares):
            lost = self.lost()
            for rank in range(self.world_size):
                if rank not in lost:
                    self.server.send(rank, {"op": ToNanny.START_SPARE})

    @classmethod
    def topology(cls, options: LaunchOptions, *, nproc: str | None, devices: str | None, backend: str | None,
                 timeout: str | None) -> Topology:
        """``--nodes x --nproc-per-node`` ranks; their devices come when they call back."""
        return remote_topology(options, backend, timeout, given_nproc=nproc, given_devices=devices,
                               launcher=cls.name)

    def memory(self) -> dict[int, tuple[int | None, int | None]]:
        """Each live rank's memory as its nanny reads it on its host (all asked at once; a nanny
        that does not answer within 2 s leaves its rank's figures unknown)."""
        server = self.server
        lost = self.lost()
        pending = {p.rank: server.request_async(p.rank, ToNanny.USAGE) for p in self.ranks
                   if p.alive and p.rank not in lost}
        deadline = time.monotonic() + 2.0
        usage: dict[int, tuple[int | None, int | None]] = {}
        for rank, rid in pending.items():
            reply = server.collect(rid, max(0.0, deadline - time.monotonic())) or {}
            rss, gpu = reply.get("rss"), reply.get("gpu")
            usage[rank] = (rss if isinstance(rss, int) else None, gpu if isinstance(gpu, int) else None)
        return usage

    def checkpoint(self, action: str, ranks: list[int], timeout_s: float) -> dict[int, dict[str, Any] | None] | None:
        """Each rank's nanny suspends or resumes its kernel's CUDA state on its host, all at once."""
        pending = {r: self.server.request_async(r, ToNanny.CHECKPOINT, action=action) for r in ranks}
        deadline = time.monotonic() + timeout_s
        return {r: self.server.collect(rid, max(0.0, deadline - time.monotonic())) for r, rid in pending.items()}

    def lost(self) -> list[int]:
        """Ranks not heard from for :data:`LOST_AFTER_S` (their host is down or cut off)."""
        return [r for r in sorted(self.server.peers) if self.server.is_lost(r)]

    def stop(self, grace_s: float = supervisor.STOP_GRACE_S, *, polite: bool = True) -> list[str]:
        """End every kernel at once (each nanny's supervisor ends what the kernel started), polite
        or not: a nanny always ends its kernel with SIGTERM to the supervisor. A lost rank cannot
        hear it: it is named, and its nanny ends it after the orphan timeout."""
        server = self.server
        pending = {}
        lost = self.lost()
        for rank in sorted(server.peers):
            if rank not in lost:
                pending[rank] = server.request_async(rank, ToNanny.STOP_KERNEL, grace_s=grace_s)
        left = [f"rank {r} on {server.peers[r].hello.get('host')} is lost; its nanny ends its kernel "
                f"{self.options.orphan_timeout_s:.0f} s after it last heard from this notebook" for r in lost]
        deadline = time.monotonic() + grace_s + 3.0
        for rank, rid in pending.items():
            if server.collect(rid, max(0.0, deadline - time.monotonic())) is None:
                left.append(f"rank {rank} on {server.peers[rank].hello.get('host')} (its nanny did not confirm)")
        return left

    def close(self) -> None:
        """Tell every nanny to exit, end the launcher's own process, close the endpoint and
        remove the files; the last three happen whatever the first did."""
        server = self.server
        lost = self.lost()
        # With a rank lost, the others exit with a failure: torchrun then leaves at once instead
        # of waiting (300 s) in its exit barrier for the lost host's agent, which never comes.
        code = 1 if lost else 0
        for rank in list(server.peers):
            try:
                server.send(rank, {"op": ToNanny.EXIT, "code": code})
            except ClorchError as exc:
                logger.debug("rank %d: %s", rank, exc)
        time.sleep(0.2)  # the exits leave before the socket closes
        try:
            self.end(bool(lost))
        finally:
            server.close()
            remove_quietly(self.connect_file)
            shutil.rmtree(self.dir, ignore_errors=True)
