"""Two simulated hosts on this machine and a real two-node Slurm cluster, for the multi-host tests.

Why: clorch_repl's multi-host code (ranks on other hosts, started by Slurm or attached by hand)
must be exercised across real network boundaries, but the tests run on one machine. Linux network
namespaces give each "host" its own network stack, hostname and /etc/hosts; Slurm's daemons are
the real ones. Nothing here is mocked; only the hosts are virtual.

What `TwoHosts.up()` makes (as root; a few seconds):
- two network namespaces, "hostA" and "hostB", each with an ``eth0`` (a veth pair) on a private
  bridge; addresses 10.77.N.1 (hostA) and 10.77.N.2 (hostB) on 10.77.N.0/24, where N = 160 + slot;
- the notebook's "host": the root namespace, at 10.77.N.254 on the bridge (`notebook_addr`);
- a hosts file naming hostA, hostB and ``nbhost`` (the notebook), bind-mounted over /etc/hosts for
  every command run "on" a host, so that hostnames resolve there (torchrun needs that);
- munged (as root, its own socket and a copy of the munge key), slurmctld in the root namespace,
  and one slurmd "on" each host: a two-node cluster (nodes hostA and hostB, 2 CPUs each,
  partition ``debug``). `up()` returns once ``sinfo`` shows both nodes idle.
Everything lives in a private temporary directory (mode 0700): slurm.conf, state, logs, pid files,
the munge socket and key. `down()` kills the daemons by their pid files, kills whatever is still
inside the namespaces, removes namespaces, bridge and the directory.

Slots: up to `SLOTS` fixtures can run at once on one machine (two pytest sessions, say). Each
takes the first free slot, held by an flock on ``/run/lock/clorch-hosts-<slot>.lock`` for its
lifetime; all its names carry the slot (``clorch-<slot>-hostA``, bridge ``clorch-br<slot>``, veths
``clorch-v<slot>A``), as do its subnet and slurmctld port. A slot whose lock is free but whose
names exist is the leftover of a crashed run: `up()` cleans it first (its temp dir is recorded in
the lock file).

Traps (found the hard way, see /work/shared/hosts/two-hosts.sh):
- ``ip netns exec`` remounts /sys for the namespace, which breaks slurmd: commands run "on" a host
  use ``nsenter --net=/run/netns/NAME unshare --uts --mount`` instead (`on_host`);
- slurmctld refuses to start unless ``SlurmctldHost`` names this machine: ``$(hostname)(ADDR)``;
- torchrun across the hosts needs resolvable hostnames (hence the hosts file), and
  ``--max-restarts 0`` so that a failure ends it instead of restarting the group;
- munged refuses a socket in a directory others cannot enter unless ``--force``; it runs as root
  here (only root's tests talk to it), so key and socket stay in the 0700 directory;
- the slurmd of a host is itself a process in that host's namespace: `processes_in` leaves it out
  unless asked (``include_daemons=True``).

How a test uses it::

    from cluster import two_hosts, two_hosts_clean  # noqa: F401

    pytestmark = pytest.mark.hosts

    def test_something(two_hosts_clean):
        hosts = two_hosts_clean
        out = hosts.run_on_host("hostA", ["hostname"]).stdout       # "hostA\\n"
        proc = hosts.on_host("hostB", [sys.executable, "worker.py"])  # a Popen
        subprocess.run(["srun", "-N2", "-n2", "hostname"], env=hosts.slurm_env())

``two_hosts`` is session-scoped (one cluster per test session; ``from cluster import two_hosts``
is all a test needs); ``two_hosts_clean`` is the same object per test, and after the test fails
it if any process is left in either host (killing them) or a Slurm job still runs (cancelling
it), and brings cut links back up. Both skip when not root or when ip, nsenter, unshare or the
Slurm/munge binaries are missing, except under CI=1, where they fail.

Good to know:
- the root namespace (the notebook) does not resolve hostA/hostB (its /etc/hosts is untouched):
  use `addr("hostA")` there; on the hosts, ``nbhost`` names the notebook;
- jobs started by Slurm run as root in their node's namespaces, with srun's environment;
- slurmctld listens on every address of this machine (Slurm has no setting to bind one); munge
  authentication, with a socket only root can reach, is what keeps others out;
- ^C runs the fixture's teardown; a SIGKILLed session leaves its slot behind until the next
  `up()` that takes that slot cleans it;
- torchrun workers on a host log "[c10d] The hostname of the client socket cannot be retrieved":
  the store sees IPv4-mapped IPv6 peers, which the hosts file does not name; harmless.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from typing import IO, Any, Iterator, Mapping, Sequence

import pytest

logger = logging.getLogger(__name__)

HOSTS = ("hostA", "hostB")
NOTEBOOK_NAME = "nbhost"
SLOTS = 8
SUBNET_BASE = 160  # slot N uses 10.77.(160+N).0/24: clear of the shared recipe's 10.77.0.0/24
CTLD_PORT_BASE = 17110  # slurmctld listens in the root namespace: one port per slot
SLURMD_PORT = 17210  # slurmd listens inside its own namespace: no clash between slots
TEMP_PREFIX = "clorch-hosts-"
UP_TIMEOUT_S = 30.0
LOCK_DIR = "/run/lock" if os.path.isdir("/run/lock") else tempfile.gettempdir()
# Binaries the fixture needs; found on PATH and in the sbin directories (root's PATH may lack them).
_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin", "/bin"]
)
REQUIRED = (
    "ip", "nsenter", "unshare", "mount", "hostname",
    "munged", "slurmctld", "slurmd", "srun", "sinfo", "squeue", "scancel",
)
# What a pid file of ours may name (checked before a kill, in case the pid was reused).
_DAEMON_NAMES = {"munged", "slurmctld", "slurmd"}


def _which(name: str) -> str | None:
    return shutil.which(name, path=_SEARCH_PATH)


def missing_requirements() -> str | None:
    """Why the fixture cannot run here (not root, a binary missing), or None when it can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, bridge, Slurm daemons)"
    absent = [n for n in REQUIRED if _which(n) is None]
    if absent:
        return (
            f"simulated hosts need {', '.join(absent)}: "
            "apt-get install -y slurmctld slurmd slurm-client munge (and iproute2, util-linux)"
        )
    if not os.path.exists("/etc/munge/munge.key") and _which("mungekey") is None:
        return "simulated hosts need /etc/munge/munge.key or mungekey to create a key"
    return None


def _comm(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _read_pid(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def _kill_and_wait(pids: Sequence[int], timeout: float) -> list[int]:
    """SIGTERM pids, SIGKILL those still alive after timeout; return those that never went."""
    for pid in pids:
        with _quiet_kill():
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    for pid in alive:
        with _quiet_kill():
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


class _quiet_kill:
    """Context: a process that is already gone is what we wanted; log anything else."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, ProcessLookupError):
            return True
        if isinstance(exc, OSError):
            logger.warning("kill failed: %s", exc)
            return True
        return False


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(cannot read: {e})\n"


class TwoHosts:
    """Two simulated hosts (network namespaces) and a two-node Slurm cluster; see the module doc."""

    hosts = HOSTS

    def __init__(self) -> None:
        self.slot: int | None = None
        self.tmpdir: str | None = None
        self._lock: IO[str] | None = None
        self._bin = {n: _which(n) or n for n in REQUIRED}
        self.up_seconds: float | None = None
        self.down_seconds: float | None = None

    # --- names -------------------------------------------------------------------------------

    def _check_up(self) -> int:
        if self.slot is None or self.tmpdir is None:
            raise RuntimeError("TwoHosts is not up: call up() first (or use the two_hosts fixture)")
        return self.slot

    @staticmethod
    def _names(slot: int) -> dict[str, Any]:
        return {
            "bridge": f"clorch-br{slot}",
            "netns": {h: f"clorch-{slot}-{h}" for h in HOSTS},
            "veth": {h: f"clorch-v{slot}{h[-1]}" for h in HOSTS},
            "net": f"10.77.{SUBNET_BASE + slot}",
        }

    def _check_host(self, host: str) -> str:
        if host not in HOSTS:
            raise ValueError(f"unknown host {host!r}: the simulated hosts are {', '.join(HOSTS)}")
        return host

    def netns(self, host: str) -> str:
        """The network namespace's name (``ip netns``) of host."""
        return self._names(self._check_up())["netns"][self._check_host(host)]

    def netns_path(self, host: str) -> str:
        return f"/run/netns/{self.netns(host)}"

    def veth(self, host: str) -> str:
        """The root-namespace end of host's link (what link_down/link_up switch)."""
        return self._names(self._check_up())["veth"][self._check_host(host)]

    def addr(self, host: str) -> str:
        """The IPv4 address of hostA, hostB, or of the notebook ("notebook" or "nbhost")."""
        net = self._names(self._check_up())["net"]
        if host in ("notebook", NOTEBOOK_NAME):
            return f"{net}.254"
        return f"{net}.{HOSTS.index(self._check_host(host)) + 1}"

    @property
    def notebook_addr(self) -> str:
        """The notebook's host: the root namespace's address on the bridge."""
        return self.addr("notebook")

    @property
    def hosts_file(self) -> str:
        """The /etc/hosts every host sees (hostA, hostB, nbhost)."""
        return os.path.join(self._tmp(), "hosts")

    @property
    def slurm_conf(self) -> str:
        return os.path.join(self._tmp(), "slurm", "slurm.conf")

    def _tmp(self) -> str:
        self._check_up()
        assert self.tmpdir is not None
        return self.tmpdir

    def _slurm(self, *parts: str) -> str:
        return os.path.join(self._tmp(), "slurm", *parts)

    # --- running commands ---------------------------------------------------------------------

    def host_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """argv wrapped so that it runs "on" host: its net namespace, hostname and /etc/hosts.

        nsenter (not ``ip netns exec``, which remounts /sys and breaks slurmd) joins the
        namespace; unshare gives a private hostname and mount namespace, where the hosts file is
        bind-mounted over /etc/hosts. Each step execs the next: the process is argv itself.
        """
        script = (
            f"{shlex.quote(self._bin['hostname'])} {shlex.quote(self._check_host(host))} && "
            f"{shlex.quote(self._bin['mount'])} --bind {shlex.quote(self.hosts_file)} /etc/hosts"
            ' && exec "$@"'
        )
        return [
            self._bin["nsenter"], f"--net={self.netns_path(host)}",
            self._bin["unshare"], "--uts", "--mount", "--propagation", "private",
            "/bin/sh", "-c", script, "sh", *argv,
        ]

    def on_host(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen:
        """Start argv "on" host (hostA or hostB); its pid is argv's own process."""
        return subprocess.Popen(
            self.host_argv(host, argv), env=dict(env) if env is not None else None, **popen_kwargs
        )

    def run_on_host(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 60,
        check: bool = False,
        **run_kwargs: Any,
    ) -> subprocess.CompletedProcess:
        """Run argv "on" host to the end; stdout and stderr captured as text unless told otherwise."""
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        return subprocess.run(
            self.host_argv(host, argv),
            env=dict(env) if env is not None else None,
            timeout=timeout,
            check=check,
            **run_kwargs,
        )

    def slurm_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment (base, default os.environ) whose Slurm commands talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.slurm_conf
        return env

    def squeue(self) -> list[str]:
        """The cluster's jobs, one line each: "JOBID STATE NODES NAME" (empty list: no job)."""
        out = self._check_run([self._bin["squeue"], "-h", "-o", "%i %T %N %j"], env=self.slurm_env())
        return [line for line in out.splitlines() if line.strip()]

    def wait_no_jobs(self, timeout: float = 10.0) -> list[str]:
        """Wait until squeue is empty (a finished job stays COMPLETING a moment); return what is left."""
        deadline = time.monotonic() + timeout
        jobs = self.squeue()
        while jobs and time.monotonic() < deadline:
            time.sleep(0.1)
            jobs = self.squeue()
        return jobs

    def sinfo(self) -> dict[str, str]:
        """Node name -> Slurm state (idle, allocated, down, ...)."""
        out = self._check_run([self._bin["sinfo"], "-h", "-N", "-o", "%N %T"], env=self.slurm_env())
        states = {}
        for line in out.splitlines():
            if line.strip():
                node, state = line.split(None, 1)
                states[node] = state.strip()
        return states

    # --- links and processes ------------------------------------------------------------------

    def link_down(self, host: str) -> None:
        """Cut host off the network (its veth goes down; packets to and from it are dropped)."""
        self._check_run([self._bin["ip"], "link", "set", self.veth(host), "down"])

    def link_up(self, host: str) -> None:
        self._check_run([self._bin["ip"], "link", "set", self.veth(host), "master",
                       self._names(self._check_up())["bridge"], "up"])

    def daemon_pids(self) -> dict[str, int]:
        """Pid of each daemon started (munged, slurmctld, slurmd-hostA, slurmd-hostB) still alive."""
        return {
            name: pid
            for name, pid in ((n, _read_pid(p)) for n, p in _pid_files(self._tmp()).items())
            if pid is not None and _alive(pid) and _comm(pid) in _DAEMON_NAMES
        }

    def processes_in(self, host: str, include_daemons: bool = False) -> list[int]:
        """Pids of the live processes whose network namespace is host's (slurmd left out)."""
        pids = _pids_in_netns(self.netns_path(host))
        if not include_daemons:
            daemons = set(self.daemon_pids().values())
            pids = [p for p in pids if p not in daemons]
        return pids

    def kill_leftovers(self, timeout: float = 5.0) -> dict[str, list[int]]:
        """Kill every process (but slurmd) in either host; return what was there, per host."""
        found = {h: self.processes_in(h) for h in HOSTS}
        pids = [p for ps in found.values() for p in ps]
        if pids:
            stuck = _kill_and_wait(pids, timeout)
            if stuck:
                logger.warning("processes in the simulated hosts survived SIGKILL: %s", stuck)
        return {h: ps for h, ps in found.items() if ps}

    # --- up and down --------------------------------------------------------------------------

    def up(self) -> "TwoHosts":
        """Make the hosts and start the cluster; returns once both Slurm nodes are idle."""
        if self.slot is not None:
            return self
        why = missing_requirements()
        if why:
            raise RuntimeError(why)
        start = time.monotonic()
        self._take_slot()
        try:
            self._make_network()
            self._start_slurm()
        except BaseException:
            self.down()
            raise
        self.up_seconds = time.monotonic() - start
        logger.info("two hosts up in slot %s (%s) in %.1f s", self.slot, self.tmpdir, self.up_seconds)
        return self

    def down(self) -> None:
        """Stop the daemons, kill what is left in the hosts, remove network and files. Idempotent."""
        if self.slot is None:
            return
        start = time.monotonic()
        slot, tmpdir = self.slot, self.tmpdir
        try:
            _clean_slot(slot, tmpdir, self._bin)
        finally:
            self.slot = None
            self.tmpdir = None
            if self._lock is not None:
                try:
                    self._lock.seek(0)
                    self._lock.truncate()
                finally:
                    self._lock.close()  # releases the flock
                    self._lock = None
        self.down_seconds = time.monotonic() - start
        logger.info("two hosts of slot %s down in %.1f s", slot, self.down_seconds)

    def _take_slot(self) -> None:
        taken = []
        for slot in range(SLOTS):
            path = os.path.join(LOCK_DIR, f"clorch-hosts-{slot}.lock")
            f = open(path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                taken.append(slot)
                continue
            # Free lock: whatever carries this slot's names is a crashed run's leftover.
            f.seek(0)
            previous = f.read().strip()
            _clean_slot(slot, previous or None, self._bin)
            self.tmpdir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{slot}-")  # mode 0700
            f.seek(0)
            f.truncate()
            f.write(self.tmpdir + "\n")
            f.flush()
            self._lock = f
            self.slot = slot
            return
        raise RuntimeError(
            f"all {SLOTS} simulated-host slots are in use (locks {LOCK_DIR}/clorch-hosts-*.lock "
            f"held by other test sessions: {taken}); wait for them or stop them"
        )

    def _make_network(self) -> None:
        names = self._names(self._check_up())
        net, bridge = names["net"], names["bridge"]
        clash = self._check_run([self._bin["ip"], "-o", "-4", "addr"])
        if f" {net}." in clash:
            raise RuntimeError(
                f"subnet {net}.0/24 is already on an interface here; free it or change SUBNET_BASE"
            )
        with open(self.hosts_file, "w") as f:
            f.write(f"127.0.0.1 localhost\n{net}.254 {NOTEBOOK_NAME}\n")
            for host in HOSTS:
                f.write(f"{self.addr(host)} {host}\n")
        os.chmod(self.hosts_file, 0o644)
        ip = self._bin["ip"]
        cmds = [
            [ip, "link", "add", bridge, "type", "bridge"],
            [ip, "addr", "add", f"{net}.254/24", "dev", bridge],
            [ip, "link", "set", bridge, "up"],
        ]
        for host in HOSTS:
            ns, veth = names["netns"][host], names["veth"][host]
            cmds += [
                [ip, "netns", "add", ns],
                [ip, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns],
                [ip, "link", "set", veth, "master", bridge, "up"],
                [ip, "-n", ns, "link", "set", "lo", "up"],
                [ip, "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0"],
                [ip, "-n", ns, "link", "set", "eth0", "up"],
            ]
        for cmd in cmds:
            self._check_run(cmd)

    def _start_slurm(self) -> None:
        tmp = self._tmp()
        munge = os.path.join(tmp, "munge")
        os.makedirs(munge, mode=0o700)
        for sub in ("state", "log", *(os.path.join("spool", h) for h in HOSTS)):
            os.makedirs(self._slurm(sub), mode=0o700)
        key = os.path.join(munge, "munge.key")
        if os.path.exists("/etc/munge/munge.key"):
            shutil.copyfile("/etc/munge/munge.key", key)
        else:
            self._check_run([_which("mungekey") or "mungekey", "--create", f"--keyfile={key}"])
        os.chmod(key, 0o600)
        socket_path = os.path.join(munge, "munge.socket")
        # As root, with --force: the socket's directory is our 0700 temp dir (munged wants others
        # to be able to enter it; only root uses this one).
        self._check_run([
            self._bin["munged"], "--force", f"--socket={socket_path}", f"--key-file={key}",
            f"--pid-file={os.path.join(munge, 'munged.pid')}",
            f"--log-file={os.path.join(munge, 'munged.log')}",
            f"--seed-file={os.path.join(munge, 'munged.seed')}",
        ])
        self._write_slurm_conf(socket_path)
        self._check_run([self._bin["slurmctld"], "-f", self.slurm_conf, "-i"])
        for host in HOSTS:
            # slurmd daemonizes: the command returns once it has forked (pid in its pid file).
            done = self.run_on_host(host, [self._bin["slurmd"], "-f", self.slurm_conf], timeout=30)
            if done.returncode != 0:
                raise RuntimeError(
                    f"slurmd on {host} failed to start (rc {done.returncode}): "
                    f"{done.stderr.strip()}\n{self.logs_tail()}"
                )
        deadline = time.monotonic() + UP_TIMEOUT_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                states = self.sinfo()
            except RuntimeError:
                states = {}  # slurmctld not answering yet
            if all(states.get(h) == "idle" for h in HOSTS):
                return
            if any(state.startswith("inval") for state in states.values()):
                break  # slurmctld refused a node's registration: waiting will not help
            time.sleep(0.1)
        raise RuntimeError(
            f"the Slurm cluster did not come up (node states: {states or 'none'}; idle wanted within"
            f" {UP_TIMEOUT_S:.0f} s);"
            f" logs follow; config {self.slurm_conf}\n{self.logs_tail()}"
        )

    def _write_slurm_conf(self, munge_socket: str) -> None:
        slot = self._check_up()
        nodes = "".join(
            f"NodeName={h} NodeAddr={self.addr(h)} CPUs=2 State=UNKNOWN\n" for h in HOSTS
        )
        conf = f"""\
# Made by tests/cluster.py for simulated hosts of slot {slot}; removed by down().
ClusterName=clorch{slot}
SlurmctldHost={os.uname().nodename}({self.notebook_addr})
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort={CTLD_PORT_BASE + slot}
SlurmdPort={SLURMD_PORT}
StateSaveLocation={self._slurm('state')}
SlurmdSpoolDir={self._slurm('spool', '%n')}
SlurmctldPidFile={self._slurm('slurmctld.pid')}
SlurmdPidFile={self._slurm('slurmd-%n.pid')}
SlurmctldLogFile={self._slurm('log', 'slurmctld.log')}
SlurmdLogFile={self._slurm('log', 'slurmd-%n.log')}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
MailProg=/bin/true
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.slurm_conf, "w") as f:
            f.write(conf)

    def logs_tail(self, lines: int = 15) -> str:
        """The last lines of the slurmctld, slurmd and munged logs (for error messages)."""
        tmp = self._tmp()
        logs = {
            "slurmctld": self._slurm("log", "slurmctld.log"),
            **{f"slurmd on {h}": self._slurm("log", f"slurmd-{h}.log") for h in HOSTS},
            "munged": os.path.join(tmp, "munge", "munged.log"),
        }
        return "".join(f"--- {name} ({path}):\n{_tail(path, lines)}" for name, path in logs.items())

    @staticmethod
    def _check_run(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
        """Run a set-up command; raise with its stderr when it fails."""
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=30,
            env=dict(env) if env is not None else None,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv)} failed (rc {done.returncode}): {done.stderr.strip()}"
            )
        return done.stdout


def _pid_files(tmpdir: str) -> dict[str, str]:
    slurm = os.path.join(tmpdir, "slurm")
    return {
        **{f"slurmd-{h}": os.path.join(slurm, f"slurmd-{h}.pid") for h in HOSTS},
        "slurmctld": os.path.join(slurm, "slurmctld.pid"),
        "munged": os.path.join(tmpdir, "munge", "munged.pid"),
    }


def _netns_inode(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _pids_in_netns(path: str) -> list[int]:
    """Live pids whose /proc/PID/ns/net is the namespace mounted at path."""
    want = _netns_inode(path)
    if want is None:
        return []
    me = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        if _netns_inode(f"/proc/{entry}/ns/net") == want and _alive(int(entry)):
            pids.append(int(entry))
    return pids


def _clean_slot(slot: int, tmpdir: str | None, bins: Mapping[str, str]) -> None:
    """Remove everything of slot: daemons (by pid file), processes in its namespaces, network, files.

    Used by down() and by up() on a crashed run's leftovers; each step tolerates absent parts.
    """
    names = TwoHosts._names(slot)
    ours = tmpdir is not None and os.path.basename(tmpdir).startswith(f"{TEMP_PREFIX}{slot}-")
    if tmpdir is not None and ours and os.path.isdir(tmpdir):
        daemons = []
        for name, path in _pid_files(tmpdir).items():
            pid = _read_pid(path)
            # A pid file outlives its process; the pid may since belong to someone else.
            if pid is not None and _alive(pid) and _comm(pid) in _DAEMON_NAMES:
                daemons.append(pid)
        stuck = _kill_and_wait(daemons, timeout=5)
        if stuck:
            logger.warning("slot %s: daemons %s survived SIGKILL", slot, stuck)
    leftovers = {h: _pids_in_netns(f"/run/netns/{ns}") for h, ns in names["netns"].items()}
    pids = [p for ps in leftovers.values() for p in ps]
    if pids:
        logger.warning("slot %s: killing processes left in the simulated hosts: %s", slot, leftovers)
        stuck = _kill_and_wait(pids, timeout=3)
        if stuck:
            logger.warning("slot %s: processes %s survived SIGKILL", slot, stuck)
    ip = bins.get("ip", "ip")
    for ns in names["netns"].values():
        if os.path.exists(f"/run/netns/{ns}"):
            _run_logged([ip, "netns", "del", ns])
    for veth in names["veth"].values():
        if os.path.exists(f"/sys/class/net/{veth}"):
            _run_logged([ip, "link", "del", veth])
    if os.path.exists(f"/sys/class/net/{names['bridge']}"):
        _run_logged([ip, "link", "del", names["bridge"]])
    if tmpdir is not None and ours:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _run_logged(argv: Sequence[str]) -> None:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        logger.warning("%s failed (rc %s): %s", " ".join(argv), done.returncode, done.stderr.strip())


# --- pytest fixtures ------------------------------------------------------------------------------


def _skip_or_fail(why: str) -> None:
    """Skip, but fail under CI=1: CI must run the multi-host tests."""
    if os.environ.get("CI") == "1":
        pytest.fail(f"CI=1 and {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def two_hosts(request: pytest.FixtureRequest) -> Iterator[TwoHosts]:
    """The session's two simulated hosts and Slurm cluster (up before, down after, even on ^C)."""
    why = missing_requirements()
    if why:
        _skip_or_fail(why)
    cluster = TwoHosts()
    # Registered before up(): a half-made cluster is removed too; atexit covers an exit that
    # skips pytest's teardown.
    request.addfinalizer(cluster.down)
    atexit.register(cluster.down)
    cluster.up()
    yield cluster


@pytest.fixture()
def two_hosts_clean(two_hosts: TwoHosts) -> Iterator[TwoHosts]:
    """two_hosts for one test; afterwards fails the test if it left processes in a host."""
    yield two_hosts
    for host in HOSTS:
        two_hosts.link_up(host)
    jobs = two_hosts.squeue()
    if all(job.split()[1] == "COMPLETING" for job in jobs):
        jobs = two_hosts.wait_no_jobs()  # finished jobs are cleaned up by Slurm in a moment
    if jobs:
        subprocess.run([two_hosts._bin["scancel"], "--full", *[j.split()[0] for j in jobs]],
                       env=two_hosts.slurm_env(), capture_output=True, timeout=30)
    # Processes the test ended (or Slurm is ending) may take a moment to go.
    deadline = time.monotonic() + 10
    left = {h: two_hosts.processes_in(h) for h in HOSTS}
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {h: two_hosts.processes_in(h) for h in HOSTS}
    described = {
        h: [f"{p} {_comm(p)}" for p in ps] for h, ps in left.items() if ps
    }
    killed = two_hosts.kill_leftovers()
    if killed or jobs:
        pytest.fail(
            f"the test left processes in the simulated hosts (now killed): {described or 'none'}; "
            f"Slurm jobs (now cancelled): {jobs or 'none'}",
            pytrace=False,
        )
