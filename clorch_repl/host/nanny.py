"""A rank's nanny: ``python -m clorch_repl.rank`` (also ``clorch-rank``), one rank of a multi-host session.

What every launcher runs on a node (``srun``, ``torchrun``, any scheduler that sets the rank
variables). This process is the rank's **nanny**; it never runs user code itself:

1. reads who it is from the launcher's environment: torchrun's ``RANK``/``LOCAL_RANK``/
   ``WORLD_SIZE``/``LOCAL_WORLD_SIZE``, or Slurm's ``SLURM_PROCID``/``SLURM_LOCALID``/
   ``SLURM_NTASKS``/``SLURM_STEP_TASKS_PER_NODE`` with ``SLURM_NODEID``;
2. calls ``setsid`` (Slurm puts all of a node's tasks in one process group; a signal meant for
   one rank must not reach the others);
3. reads the notebook's address, public key and token from ``CLORCH_CONNECT`` (srun hands it
   every task) or else the connect file named by ``CLORCH_CONNECT_FILE``, and calls back over CurveZMQ (:mod:`clorch_repl.launchers.callback`);
4. on the notebook's word, starts the rank's kernel as its child (below a
   :mod:`~clorch_repl.host.supervisor`, which ends everything the kernel starts), its
   channels bound to this host's address that reaches the notebook and encrypted with Curve keys
   made here; reports the kernel's connection info;
5. stays: reports the kernel's exit at once, delivers interrupts, stack dumps, log tails, a fresh
   kernel (``%clorch restart``) and stop on request. It does **not** exit because its kernel
   died, so srun or torchrun do not tear the allocation down (when asked, it keeps a warm spare
   kernel beside the rank's, which a restart makes the rank's kernel; see
   clorch_repl.launchers.local on spares); it exits when the notebook says
   stop, or, after ``--orphan-timeout`` seconds without a word from the notebook (its kernel
   gone, its host cut off), after ending its kernel and everything below it.

Exit status: 0 after the notebook's stop (1 when the stop came with another rank lost, so that
torchrun fails fast instead of waiting for the lost host); 2 when the notebook refused the rank (wrong world size,
a duplicate rank, a used-up token) or the connect file is unusable; 3 when orphaned; 4 when it
called back after the notebook had declared its rank lost (a healed partition) and was told to end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Mapping

import zmq

from .. import cuda
from ..common.atomic import remove_quietly
from ..errors import ClorchError
from . import supervisor
from .logfiles import remove_keeping_logs
from ..wire.connect import HEARTBEAT_S, ORPHAN_TIMEOUT_S, ConnectInfo, route_address
from ..wire.nanny import PROTOCOL, FromNanny, ToNanny, decode, encode
from .rank_process import RankProcess
from .rankfiles import RankFiles
from ..kernel import KERNEL_MODULE, STACK_FILE_ENV
from ..common.procs import free_port, tree_rss
from ..wire.rank_env import RANK_LOG_ENV, SPARE_ENV, Identity, RankPlace, rank_environment, read_identity

logger = logging.getLogger(__name__)

KERNEL_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
#: How long a kernel gets to bind its ports after it was started.
KERNEL_START_S = 120.0
#: Consecutive failed handshakes (a key that is not the endpoint's) before a nanny gives up.
HANDSHAKE_FAILURES = 3
STOP_GRACE_S = supervisor.STOP_GRACE_S
#: A warm spare has run no user code: nothing of it is worth waiting for.
SPARE_GRACE_S = 1.0


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (gloo and NCCL are told to use it)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def visible_gpus(env: Mapping[str, str]) -> list[str]:
    """The GPUs this node lets the rank use, as CUDA_VISIBLE_DEVICES would name them (without
    importing torch or touching CUDA: ``nvidia-smi``)."""
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [g.strip() for g in given.split(",") if g.strip()]
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("nvidia-smi failed (%s); this rank reports no GPU", exc)
        return []
    return [line.strip() for line in out.splitlines() if line.strip().isdigit()]


class Nanny:
    """One rank's nanny (see the module docstring)."""

    def __init__(self, identity: Identity, info: ConnectInfo, orphan_timeout_s: float) -> None:
        self.identity = identity
        self.info = info
        self.orphan_timeout_s = orphan_timeout_s
        self.host = socket.gethostname()
        self.address = route_address(info.address)
        self.dir = tempfile.mkdtemp(prefix=f"clorch-rank{identity.rank}-")
        os.chmod(self.dir, 0o700)
        self.files = RankFiles(self.dir, identity.rank)
        self.config: dict[str, Any] | None = None
        #: the rank's kernel (below its supervisor), once the notebook said to start it
        self.kernel: RankProcess | None = None
        #: the warm spare: (its process, connection file, its own log), or None
        self.spare: tuple[RankProcess, str, str] | None = None
        #: the log of a spare made the rank's kernel, copied into the rank's once it listens
        self.spare_log = ""
        self.exit_reported = True
        #: (connection file, deadline) while a kernel is starting
        self.starting: tuple[str, float] | None = None
        #: the status to exit with when the notebook says exit (1 when some rank was lost, so that
        #: torchrun takes its failure path instead of waiting for the lost host's agent)
        self.exit_code = 0
        context = zmq.Context.instance()
        self.socket = context.socket(zmq.DEALER)
        public, secret = zmq.curve_keypair()
        self.socket.curve_publickey, self.socket.curve_secretkey = public, secret
        self.socket.curve_serverkey = info.server_key.encode()
        # the same name after a reconnect: the notebook keeps knowing this rank (router handover)
        self.socket.routing_id = f"{info.session}:{identity.rank}:{os.getpid()}".encode()
        self.socket.linger = 1000
        # Handshake failures are silent on the socket itself (ZeroMQ just retries); the monitor
        # tells a connect file of another or an ended session apart from a notebook that is slow.
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        self.handshake_failures = 0
        self.socket.connect(f"tcp://{info.address}:{info.port}")
        self.last_heard = time.monotonic()
        #: (request id, the checkpoint helper's process) of each %clorch suspend/resume still running
        self.checkpoints: list[tuple[Any, subprocess.Popen[str]]] = []

    # ------------------------------------------------------------------------ messages
    def send(self, message: dict[str, Any]) -> None:
        self.socket.send(encode({**message, "token": self.info.token, "rank": self.identity.rank}))

    def register(self) -> None:
        ident = self.identity
        self.send({"op": FromNanny.REGISTER, "protocol": PROTOCOL, "world_size": ident.world_size, "local_rank": ident.local_rank,
                   "local_world_size": ident.local_world_size, "host": self.host, "address": self.address,
                   "ifname": interface_of(self.address), "pid": os.getpid(), "gpus": visible_gpus(os.environ),
                   "launcher": ident.launcher,
                   # rank 0 picks the group's MASTER_PORT on its own host (never torchrun's store port)
                   "master_port": free_port(self.address) if ident.rank == 0 else None})

    # ------------------------------------------------------------------------ the kernel
    def _spawn(self, spare: bool) -> tuple[RankProcess, str, str]:
        """Start a kernel below a supervisor: the rank's (output to the rank's log, whose banner
        this writes), or a warm spare (output to a log of its own until it is made the rank's
        kernel; imports done, no CUDA; see clorch_repl.launchers.local). Returns the process, the
        connection file and the spare's log ("" for the rank's)."""
        assert self.config is not None
        cfg = self.config
        place = RankPlace(rank=self.identity.rank, local_rank=self.identity.local_rank,
                          world_size=self.identity.world_size, local_world_size=self.identity.local_world_size,
                          master_addr=cfg["master_addr"], master_port=int(cfg["master_port"]),
                          backend=cfg["backend"], timeout_s=float(cfg["timeout_s"]), gpu=cfg.get("gpu"),
                          host_gpus=tuple(str(g) for g in cfg.get("host_gpus") or ()),
                          socket_ifname=interface_of(self.address), cpu_bind=cfg.get("cpu_bind", "none"))
        env = rank_environment(place)
        env[STACK_FILE_ENV] = self.files.stack_path
        # as the local launcher does: debugpy's frozen-modules warning would fill a death report
        env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        env.update(cfg.get("env", {}))
        tag = secrets.token_hex(4)
        connection_file = os.path.join(self.dir, f"{'spare' if spare else 'kernel'}-{tag}.json")
        pid_file = os.path.join(self.dir, f"{'spare' if spare else 'kernel'}-{tag}.pid")
        public, secret = zmq.curve_keypair()
        fd = os.open(connection_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"transport": "tcp", "ip": self.address, "key": secrets.token_hex(32),
                       "signature_scheme": "hmac-sha256", "curve_publickey": public.decode(),
                       "curve_secretkey": secret.decode(), **{p: 0 for p in KERNEL_PORTS}}, fh)
        spare_log = ""
        if spare:
            env[SPARE_ENV] = "1"
            env[RANK_LOG_ENV] = self.files.log_path
            spare_log = os.path.join(self.dir, f"spare-{tag}.log")
            log_fd = self.files.open_spare_log(spare_log)
        else:
            log_fd = self.files.open_log()
        process = RankProcess.spawn([sys.executable, "-m", KERNEL_MODULE, "-f", connection_file],
                                    env=env, log_fd=log_fd, pid_file=pid_file,
                                    cwd=cfg.get("cwd") if os.path.isdir(cfg.get("cwd") or "") else None)
        return process, connection_file, spare_log

    def start_kernel(self) -> None:
        """A fresh kernel for the rank: the warm spare when there is one (its start-up output goes
        into the rank's log), else a new process."""
        spare, self.spare = self.spare, None
        if spare is not None and spare[0].running:
            kernel, connection_file, self.spare_log = spare
            os.close(self.files.open_log())  # the banner; the spare's start-up follows once it listens
        else:
            if spare is not None:
                logger.warning("rank %d's warm spare ended before it was needed (%s); starting its kernel cold",
                               self.identity.rank, spare[0].exit)
                remove_quietly(spare[2])
            kernel, connection_file, _ = self._spawn(spare=False)
        self.kernel = kernel
        self.exit_reported = False
        # The main loop reports the kernel once it has bound its ports (_report_started): the
        # nanny keeps answering and sending heartbeats meanwhile, however long the start takes.
        self.starting = (connection_file, time.monotonic() + KERNEL_START_S)

    def _copy_spare_log(self) -> None:
        """A spare made the rank's kernel, now listening (its imports done, writing nothing until
        it joins and moves its output to the rank's log): its start-up goes into the rank's log."""
        spare_log, self.spare_log = self.spare_log, ""
        if spare_log:
            self.files.take_spare_log(spare_log)

    def start_spare(self) -> None:
        """Keep a warm spare for the next restart (the notebook asks once the group formed)."""
        if self.config is not None and (self.spare is None or not self.spare[0].running):
            self.spare = self._spawn(spare=True)

    def end_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None:
            spare[0].end(SPARE_GRACE_S)
            remove_quietly(spare[2])

    def _report_started(self) -> None:
        """Once the starting kernel has bound its ports and written them back to its connection
        file, send its connection info to the notebook; give up on a kernel that never does."""
        if self.starting is None:
            return
        path, deadline = self.starting
        if self.kernel is None or not self.kernel.running:
            self.starting = None  # its exit is reported by _check_kernel, with what it wrote
            self._copy_spare_log()
            return
        try:
            with open(path) as fh:
                info = json.load(fh)
        except (OSError, ValueError):
            info = {}  # not written yet, or half-written
        if all(info.get(p) for p in KERNEL_PORTS):
            self.starting = None
            self._copy_spare_log()
            self.send({"op": FromNanny.KERNEL, "info": info, "pid": self.kernel.rank_pid})
        elif time.monotonic() > deadline:
            logger.warning("rank %d's kernel bound no ports within %.0f s; ending it", self.identity.rank,
                           KERNEL_START_S)
            self.starting = None
            self.stop_kernel()

    def stop_kernel(self, grace_s: float = STOP_GRACE_S) -> None:
        """End the kernel and everything below it (the supervisor does the work on SIGTERM)."""
        if self.kernel is not None:
            self.kernel.end(grace_s)

    def _check_kernel(self) -> None:
        kernel = self.kernel
        if kernel is not None and not self.exit_reported and not kernel.running:
            self.exit_reported = True
            self.send({"op": FromNanny.EXITED, "how": kernel.exit,
                       "report": self.files.death_report()})

    def checkpoint(self, rid: Any, action: str) -> None:
        """``%clorch suspend/resume`` of this rank: the driver's checkpoint of its kernel's process,
        by the helper process (clorch_repl.host.cuda_checkpoint) on this host. Not waited for here: the
        loop goes on beating and answers when the helper ends (:meth:`_check_checkpoints`)."""
        kernel, where = self.kernel, f"rank {self.identity.rank} on {self.host}"
        if action not in ("suspend", "resume"):
            self.send({"op": FromNanny.REPLY, "id": rid, "error": f"{where}: no such checkpoint action {action!r}"})
            return
        if kernel is None or not kernel.running or kernel.rank_pid is None:
            self.send({"op": FromNanny.REPLY, "id": rid, "error": f"{where} has no running kernel to {action}"})
            return
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        self.checkpoints.append((rid, subprocess.Popen(
            [sys.executable, "-m", "clorch_repl.host.cuda_checkpoint", action, f"{kernel.rank_pid}={where}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)))

    def _check_checkpoints(self) -> None:
        for rid, proc in list(self.checkpoints):
            if proc.poll() is None:
                continue
            self.checkpoints.remove((rid, proc))
            out, err = proc.communicate()
            outcome = next((json.loads(line) for line in out.splitlines() if line.startswith("{")), None)
            error = "" if outcome is not None else (f"rank {self.identity.rank} on {self.host}: the checkpoint helper "
                                                    f"said nothing (exit {proc.returncode}): {err.strip()[-400:]}")
            self.send({"op": FromNanny.REPLY, "id": rid, "outcome": outcome, "error": error})

    def _check_handshakes(self) -> None:
        """Refuse to wait forever on an endpoint whose key is not the connect file's."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshake_failures = 0
            else:
                self.handshake_failures += 1
        if self.handshake_failures >= HANDSHAKE_FAILURES:
            raise ClorchError(
                f"the notebook's endpoint {self.info.address}:{self.info.port} refused this rank's encrypted "
                f"handshake {self.handshake_failures} times: the connect file's key is not that endpoint's "
                "(a connect file of another or an ended session?); use the one the waiting %clorch start printed")

    # ------------------------------------------------------------------------ the loop
    def _pump(self, timeout_s: float) -> str | None:
        """Read and handle the notebook's messages for up to ``timeout_s``; "exit" when told to."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        while self.socket.poll(0):
            message = decode(self.socket.recv())
            if message is None:
                continue
            self.last_heard = time.monotonic()
            try:
                outcome = self._handle(message)
            except ClorchError:
                raise  # refused: the nanny ends
            except Exception as exc:  # noqa: BLE001 - one bad request must not end the rank
                logger.exception("rank %d: the notebook's %r failed", self.identity.rank, message.get("op"))
                if message.get("id") is not None:
                    self.send({"op": FromNanny.REPLY, "id": message["id"], "error": f"{type(exc).__name__}: {exc}",
                               "text": ""})
                continue
            if outcome:
                return outcome
        return None

    def _handle(self, message: dict[str, Any]) -> str | None:
        op = message.get("op")
        rid = message.get("id")
        if op == ToNanny.REFUSED:
            raise ClorchError(f"the notebook refused this rank: {message.get('why')}")
        if op == ToNanny.CONFIG:
            self.config = message
            self.start_kernel()
        elif op == ToNanny.INTERRUPT:
            if self.kernel is not None:
                self.kernel.interrupt()  # one that died just now: _check_kernel reports it
        elif op == ToNanny.STACK:
            alive = self.kernel is not None and self.kernel.running
            text = self.files.dump_stack(self.kernel.pid) if self.kernel is not None and alive else ""
            self.send({"op": FromNanny.REPLY, "id": rid, "text": text})
        elif op == ToNanny.USAGE:  # %clorch status: the kernel's memory, read here on its host
            pid = self.kernel.rank_pid if self.kernel is not None and self.kernel.running else None
            gpu = cuda.memory_by_pid().get(pid) if pid is not None and (self.config or {}).get("gpu") else None
            self.send({"op": FromNanny.REPLY, "id": rid, "rss": tree_rss(pid), "gpu": gpu})
        elif op == ToNanny.LOG:
            lines = message.get("lines")
            text = self.files.log_tail(None if lines is None else int(lines))
            self.send({"op": FromNanny.REPLY, "id": rid, "text": text})
        elif op == ToNanny.STOP_KERNEL:
            self.stop_kernel(float(message.get("grace_s", STOP_GRACE_S)))
            self.exit_reported = True
            self.send({"op": FromNanny.REPLY, "id": rid, "how": (self.kernel.exit or "") if self.kernel else ""})
        elif op == ToNanny.START_KERNEL:
            self.stop_kernel()
            self.start_kernel()
        elif op == ToNanny.START_SPARE:
            self.start_spare()
        elif op == ToNanny.CHECKPOINT:
            self.checkpoint(rid, str(message.get("action")))
        elif op == ToNanny.EXIT:
            code = message.get("code", 0)
            self.exit_code = code if isinstance(code, int) and 0 <= code < 256 else 1
            if message.get("why"):  # declared lost and written off (clorch_repl.launchers.liveness)
                sys.stderr.write(f"clorch-rank {self.identity.rank}: {message['why']}; ending this rank's kernel\n")
            return "exit"
        return None

    def run(self) -> int:
        self.register()
        next_beat = time.monotonic()
        try:
            while True:
                if self._pump(0.1) == "exit":
                    return self.exit_code
                self._check_handshakes()
                self._report_started()
                self._check_kernel()
                self._check_checkpoints()
                now = time.monotonic()
                if now >= next_beat:
                    self.send({"op": FromNanny.HEARTBEAT})
                    next_beat = now + HEARTBEAT_S
                if now - self.last_heard > self.orphan_timeout_s:
                    sys.stderr.write(f"clorch-rank {self.identity.rank}: no word from the notebook at "
                                     f"{self.info.address}:{self.info.port} for {self.orphan_timeout_s:.0f} s; "
                                     "ending this rank's kernel\n")
                    return 3
        finally:
            self.end_spare()
            self.stop_kernel()
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=500)
            kept = remove_keeping_logs(self.dir)
            if kept:
                sys.stderr.write(f"clorch-rank {self.identity.rank}: its log is kept in {kept} on {self.host}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clorch-rank", description=__doc__.split("\n\n")[0])
    parser.add_argument("--orphan-timeout", type=float, default=None,
                        help="seconds without a word from the notebook before this rank ends itself "
                             f"(default: the connect file's, which is %%clorch start --orphan-timeout, "
                             f"{ORPHAN_TIMEOUT_S:.0f} unless given)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="clorch-rank: %(message)s")
    try:
        os.setsid()
    except PermissionError:
        pass  # already a session leader
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # stop_kernel runs in run()'s finally
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts are for the kernel, on request
    try:
        identity = read_identity(os.environ)
        info = ConnectInfo.from_environment(os.environ)
        orphan = args.orphan_timeout if args.orphan_timeout is not None else info.orphan_timeout_s
        return Nanny(identity, info, orphan).run()
    except ClorchError as exc:
        sys.stderr.write(f"clorch-rank: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
