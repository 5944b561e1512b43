"""A session across two hosts, driven from a real notebook kernel (issue 8's checks).

The hosts are network namespaces with their own address, hostname and /etc/hosts, and a real
two-node Slurm cluster runs on them (tests/cluster.py); the notebook kernel runs in the root
namespace and listens on its address on the hosts' bridge. Nothing of clorch_repl is mocked: the
ranks are started by the real torchrun (``attach``: the command the notebook prints, run on each
host) or the real srun (``slurm``), call back over CurveZMQ and serve their kernels on their hosts.

Every test ends what it started (``%clorch stop``, or the notebook's death) and checks that no
process is left in either host; the two_hosts_clean fixture fails a test that leaves one. The
seconds that matter to a user (start, stop, a death or a lost host noticed, an orphan's end) are
printed as ``TIMING ...`` lines (``pytest -s`` shows them). Only the issue's own bound is asserted:
an orphaned rank is gone within ``--orphan-timeout`` + 5 s; elsewhere "within seconds" is a
cell or wait that fails after tens of seconds, not minutes (torchrun's exit barrier is 300 s).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from queue import Empty
from typing import Iterator

import psutil
import pytest

from cluster import HOSTS, TwoHosts, two_hosts, two_hosts_clean  # noqa: F401
from notebook_kernel import NotebookKernel, Reply
from rank_text import lines_of

pytestmark = pytest.mark.hosts

logger = logging.getLogger(__name__)

#: torchrun of this virtual environment: what a node runs (the hosts share this filesystem).
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
ORPHAN_S = 5
#: How long a nanny/torchrun may take to go once it was told to (or orphaned): seconds, not the
#: minutes of torchrun's exit barrier.
GONE_S = 5

RANK_HOST = ("%%distributed\nimport socket\nprint(f'rank {rank} on {socket.gethostname()}')")
ALL_REDUCE = ("%%distributed\nimport torch, torch.distributed as dist\n"
              "t = torch.ones(1) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nprint('sum', t.item())")
SESSION = "from clorch_repl.magics import magics_for\ngroup = magics_for(get_ipython()).session.group\n"


def timing(what: str, seconds: float) -> None:
    print(f"TIMING {what}: {seconds:.2f} s", flush=True)


@dataclass
class Cluster:
    """The notebook kernel, the hosts, and the torchruns a test started on them."""

    nb: NotebookKernel
    hosts: TwoHosts
    torchruns: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    start_seconds: float = 0.0
    #: the session's --orphan-timeout
    orphan_s: float = ORPHAN_S

    @property
    def listen(self) -> str:
        return self.hosts.notebook_addr

    def options(self, extra: str = "") -> str:
        return f"--listen {self.listen} --orphan-timeout {self.orphan_s:g} --start-timeout 60 {extra}".strip()

    # ------------------------------------------------------------------ attach
    def send_attach(self, nodes: int = 2, nproc: int = 1, extra: str = "") -> tuple[str, str]:
        """Send an attach start; return its msg_id and the torchrun line it printed."""
        msg_id = self.nb.send(f"%clorch start --launcher attach --nodes {nodes} --nproc-per-node {nproc} "
                              f"{self.options(extra)}")
        text = wait_text(self.nb, msg_id, "torchrun", timeout=30)
        return msg_id, next(line.strip() for line in text.splitlines() if "torchrun" in line)

    def run_torchrun(self, line: str, host: str, nnodes: int = 2, nproc: int = 1) -> subprocess.Popen:
        """Run the printed torchrun line on host, as its user would (FIRST_NODE: hostA's address)."""
        argv = shlex.split(line.replace("FIRST_NODE", self.hosts.addr("hostA")))
        env = dict(os.environ)
        while argv and re.fullmatch(r"[A-Z_]+=.*", argv[0]):  # the VAR=value prefix of the line
            key, _, value = argv.pop(0).partition("=")
            env[key] = value
        assert argv[0] == "torchrun", line
        assert argv[argv.index("--nnodes") + 1] == str(nnodes) and argv[argv.index("--nproc-per-node") + 1] == str(nproc)
        assert argv[argv.index("--max-restarts") + 1] == "0", "an elastic restart would replace a rank silently"
        argv[0] = TORCHRUN
        env.setdefault("LOGLEVEL", "INFO")  # torchrun's agent says what it waits for (in its log file)
        log = os.path.join(self.hosts.tmpdir or "/tmp", f"torchrun-{host}-{len(self.logs)}.log")
        self.logs[host] = log
        with open(log, "w") as out:
            proc = self.hosts.on_host(host, argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        self.torchruns[host] = proc
        return proc

    def start_attach(self, nodes: tuple[str, ...] = HOSTS, nproc: int = 1) -> Reply:
        t0 = time.monotonic()
        msg_id, line = self.send_attach(len(nodes), nproc)
        for host in nodes:
            self.run_torchrun(line, host, len(nodes), nproc)
        reply = self.nb.collect(msg_id, timeout=120)
        self.start_seconds = time.monotonic() - t0
        assert reply.status == "ok", reply.text + self.torchrun_logs()
        timing(f"attach start, {len(nodes)} host(s) x {nproc}", self.start_seconds)
        return reply

    def torchrun_logs(self) -> str:
        out = []
        for host, path in self.logs.items():
            try:
                with open(path, errors="replace") as fh:
                    out.append(f"\n--- torchrun on {host}:\n{fh.read()[-3000:]}")
            except OSError as exc:
                out.append(f"\n--- torchrun on {host}: unreadable ({exc})")
        return "".join(out)

    # ------------------------------------------------------------------ slurm
    def start_slurm(self, nodes: int = 2, nproc: int = 2) -> Reply:
        t0 = time.monotonic()
        reply = self.nb.run(f"%clorch start --launcher slurm --nodes {nodes} --nproc-per-node {nproc} "
                            f"{self.options()}", timeout=120)
        self.start_seconds = time.monotonic() - t0
        assert reply.status == "ok", reply.text + "\n" + self.hosts.logs_tail()
        timing(f"slurm start, {nodes} node(s) x {nproc}", self.start_seconds)
        return reply

    # ------------------------------------------------------------------ looking around
    def python(self, code: str) -> str:
        """Run plain Python in the notebook kernel; return what it printed."""
        reply = self.nb.run(code, timeout=30)
        assert reply.status == "ok", reply.text
        return reply.text

    def rank_info(self) -> list[dict]:
        """Each rank's host, kernel pid and kernel connection info, as the notebook holds them."""
        text = self.python(SESSION + "import json\nprint('INFO', json.dumps([dict(host=r.host, pid=r.pid, "
                           "info=r.connection_info()) for r in group.ranks]))")
        return json.loads(text.split("INFO ", 1)[1])

    def nannies(self, host: str) -> list[int]:
        """The pids of the nannies (``python -m clorch_repl.rank``, not torchrun's line) on host."""
        return sorted(p for p in self.hosts.processes_in(host)
                      if "-m clorch_repl.rank" in cmdline(p) and "torchrun" not in cmdline(p))

    def wait_nannies_gone(self, host: str, timeout: float) -> list[int]:
        """Wait until no nanny runs on host; return those still there."""
        deadline = time.monotonic() + timeout
        while self.nannies(host) and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.nannies(host)

    def wait_hosts_empty(self, timeout: float) -> tuple[float, dict[str, list[str]]]:
        """Wait until no process is left in either host; (seconds waited, what is left)."""
        t0 = time.monotonic()
        left = self.left_in_hosts()
        while any(left.values()) and time.monotonic() - t0 < timeout:
            time.sleep(0.1)
            left = self.left_in_hosts()
        return time.monotonic() - t0, {h: ps for h, ps in left.items() if ps}

    def left_in_hosts(self) -> dict[str, list[str]]:
        return {h: [f"{p} {cmdline(p)[:120]}" for p in self.hosts.processes_in(h)] for h in HOSTS}

    def stop(self) -> tuple[Reply, float]:
        t0 = time.monotonic()
        reply = self.nb.run("%clorch stop", timeout=60)
        return reply, time.monotonic() - t0


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def running(proc: psutil.Process | int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        proc = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_text(nb: NotebookKernel, msg_id: str, needle: str, timeout: float) -> str:
    """Block until the cell's stream output contains ``needle``; return its output so far. The
    messages stay queued for ``nb.collect``."""
    deadline = time.monotonic() + timeout
    while True:
        text = "".join(m["content"]["text"] for m in nb._held  # noqa: SLF001 - read, not consumed
                       if m["msg_type"] == "stream" and m["parent_header"].get("msg_id") == msg_id)
        if needle in text:
            return text
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the cell did not print {needle!r} within {timeout} s; it printed:\n{text}")
        try:
            nb._held.append(nb.kc.get_iopub_msg(timeout=left))  # noqa: SLF001
        except Empty:
            continue


def wait_exit(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, int | None]:
    """Each process's exit code, waiting up to ``timeout`` for all (None: still running)."""
    deadline = time.monotonic() + timeout
    codes: dict[str, int | None] = {}
    for host, proc in procs.items():
        try:
            codes[host] = proc.wait(timeout=max(0.01, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            codes[host] = None
    return codes


@pytest.fixture()
def cluster(two_hosts_clean: TwoHosts, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A notebook kernel (clorch_repl loaded) that can reach the hosts' Slurm cluster; afterwards
    whatever the test left running is interrupted and stopped, and its torchruns are ended
    (two_hosts_clean then fails the test if anything is left in a host)."""
    monkeypatch.setenv("SLURM_CONF", two_hosts_clean.slurm_conf)  # the notebook kernel's srun finds the cluster
    nb = NotebookKernel()
    c = Cluster(nb, two_hosts_clean)
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        yield c
    finally:
        try:
            if nb.km.is_alive():
                nb.settle(timeout=30)
                nb.run("%clorch stop", timeout=60)
        except Exception:  # noqa: BLE001 - the cleanup goes on; the test has failed already or will
            logger.warning("stopping the notebook's ranks failed", exc_info=True)
        finally:
            nb.shutdown()
            for host, code in wait_exit(c.torchruns, timeout=10).items():
                proc = c.torchruns[host]
                if code is None:
                    logger.warning("torchrun on %s still ran after the test; killing it", host)
                    proc.kill()
                    proc.wait(timeout=10)


# ------------------------------------------------------------------------------------ the checks


def test_attach_with_the_printed_torchrun_command_on_two_hosts(cluster: Cluster) -> None:
    c = cluster
    start = c.start_attach()
    assert "ranks called back 2/2 (hosts: hostA, hostB)" in start.text, start.text

    where = c.nb.run(RANK_HOST, timeout=60)
    assert where.status == "ok", where.text
    assert lines_of(where.text, 0) == ["rank 0 on hostA"] and lines_of(where.text, 1) == ["rank 1 on hostB"]
    # each line labelled with its rank and host
    assert "[rank 0 hostA] rank 0 on hostA\n" in where.text and "[rank 1 hostB] rank 1 on hostB\n" in where.text

    total = c.nb.run(ALL_REDUCE, timeout=60)
    assert total.status == "ok", total.text
    assert all(lines_of(total.text, r) == ["sum 3.0"] for r in (0, 1)), total.text

    status = c.nb.run("%clorch status")
    rows = {int(line.split()[0]): line.split()[1] for line in status.text.splitlines() if line[:1].isdigit()}
    assert rows == {0: "hostA", 1: "hostB"}, status.text

    stopped, seconds = c.stop()
    assert stopped.status == "ok" and "stopped 2 rank(s)" in stopped.text, stopped.text
    t0 = time.monotonic()
    codes = wait_exit(c.torchruns, timeout=30)
    timing("attach stop (the magic)", seconds)
    timing("torchruns exited after stop returned", time.monotonic() - t0)
    assert codes == {"hostA": 0, "hostB": 0}, f"torchrun exit codes {codes}" + c.torchrun_logs()
    _, left = c.wait_hosts_empty(GONE_S)
    assert not left, f"processes left after stop: {left}"


def test_slurm_two_nodes_two_tasks_each(cluster: Cluster) -> None:
    c = cluster
    start = c.start_slurm(nodes=2, nproc=2)
    assert "ranks called back 4/4 (hosts: hostA, hostB)" in start.text, start.text
    jobs = c.hosts.squeue()
    assert len(jobs) == 1 and jobs[0].split()[1] == "RUNNING", jobs

    where = c.nb.run(RANK_HOST, timeout=60)
    assert where.status == "ok", where.text
    # Slurm's block distribution: ranks 0-1 on the first node, 2-3 on the second
    assert [lines_of(where.text, r) for r in range(4)] == [
        ["rank 0 on hostA"], ["rank 1 on hostA"], ["rank 2 on hostB"], ["rank 3 on hostB"]], where.text

    total = c.nb.run(ALL_REDUCE, timeout=60)
    assert total.status == "ok", total.text
    assert all(lines_of(total.text, r) == ["sum 10.0"] for r in range(4)), total.text

    srun = [p for p in psutil.Process(c.nb.pid).children(recursive=True) if p.name() == "srun"]
    assert srun, "no srun below the notebook kernel"
    stopped, seconds = c.stop()
    timing("slurm stop (the magic), 4 ranks", seconds)
    assert stopped.status == "ok" and "stopped 4 rank(s)" in stopped.text, stopped.text
    t0 = time.monotonic()
    assert c.hosts.wait_no_jobs(timeout=15) == [], "the srun step's job outlived %clorch stop"
    waited, left = c.wait_hosts_empty(GONE_S)
    timing("squeue empty and hosts empty after stop returned", time.monotonic() - t0)
    assert not left, f"processes left after stop: {left}"
    assert not [p for p in srun if running(p)], "srun outlived stop"


def test_a_killed_rank_on_host_b_is_named_and_restart_reuses_the_allocation(cluster: Cluster) -> None:
    c = cluster
    c.start_slurm(nodes=2, nproc=1)
    job = c.hosts.squeue()
    nannies = {h: c.nannies(h) for h in HOSTS}
    assert all(len(p) == 1 for p in nannies.values()), nannies
    killed_pid = c.rank_info()[1]["pid"]

    t0 = time.monotonic()
    died = c.nb.run("%%distributed --ranks 1\nimport os\nos.kill(os.getpid(), 9)", timeout=60)
    timing("a killed rank's death reported (cell returned)", time.monotonic() - t0)
    assert died.status == "error", died.text
    assert "rank 1 died" in died.text and "SIGKILL" in died.text, died.text
    assert not running(killed_pid)

    status = c.nb.run("%clorch status")
    assert re.search(r"^1\s+hostB\s+dead", status.text, re.M), status.text

    t0 = time.monotonic()
    restarted = c.nb.run("%clorch restart", timeout=120)
    timing("restart in the same allocation, 2 ranks", time.monotonic() - t0)
    assert restarted.status == "ok", restarted.text
    assert c.hosts.squeue() == job, "restart made a new Slurm job instead of reusing the allocation"
    assert {h: c.nannies(h) for h in HOSTS} == nannies, "restart replaced the nannies (the srun step)"
    assert c.rank_info()[1]["pid"] != killed_pid

    total = c.nb.run(ALL_REDUCE, timeout=60)
    assert total.status == "ok" and all(lines_of(total.text, r) == ["sum 3.0"] for r in (0, 1)), total.text
    stopped, _ = c.stop()
    assert stopped.status == "ok", stopped.text
    assert c.hosts.wait_no_jobs(timeout=15) == []
    _, left = c.wait_hosts_empty(GONE_S)
    assert not left, f"processes left after stop: {left}"
    # last, so that a missing host name does not hide whether the restart works
    assert "hostB" in died.text, "the death report does not say which host the rank was on:\n" + died.text


@pytest.mark.parametrize("launcher", ["attach", "slurm"])
def test_host_b_cut_off_fails_the_cell_naming_its_ranks(cluster: Cluster, launcher: str) -> None:
    c = cluster
    if launcher == "attach":
        c.start_attach()
    else:
        c.start_slurm(nodes=2, nproc=1)
    msg_id = c.nb.send("%%distributed\nimport time\nprint('waiting', flush=True)\ntime.sleep(600)")
    c.nb.wait_for_ranks(msg_id, "waiting", timeout=30)
    c.hosts.link_down("hostB")
    cut = time.monotonic()
    reply = c.nb.collect(msg_id, timeout=60)
    timing(f"{launcher}: hostB's cut link noticed (cell returned)", time.monotonic() - cut)
    assert reply.status == "error", reply.text
    assert "rank 1" in reply.text and "hostB" in reply.text and "lost" in reply.text, reply.text

    # hostB cannot hear the stop; the cell times the magic itself (this test polls meanwhile)
    stop_id = c.nb.send("import time\n_t0 = time.monotonic()\n%clorch stop\nprint('STOP_S', time.monotonic() - _t0)")
    # hostB's nanny has heard nothing since the cut: it ends itself (and its kernel) once orphaned
    c.wait_nannies_gone("hostB", cut + ORPHAN_S + GONE_S - time.monotonic())
    timing(f"{launcher}: hostB's nanny gone (orphaned), after the cut", time.monotonic() - cut)
    assert not c.nannies("hostB"), f"hostB's nanny outlived the orphan timeout: {c.left_in_hosts()}"
    stopped = c.nb.collect(stop_id, timeout=90)
    # it ends, naming hostB's rank as the one it could not reach
    assert stopped.status == "error" and "rank 1 on hostB is lost" in stopped.text, stopped.text
    if "STOP_S " in stopped.text:
        timing(f"{launcher}: stop with hostB lost", float(stopped.text.split("STOP_S ")[1].split()[0]))
    assert c.wait_nannies_gone("hostA", GONE_S) == [], "hostA's nanny outlived %clorch stop"
    c.hosts.link_up("hostB")
    if launcher == "slurm":
        assert c.hosts.wait_no_jobs(timeout=30) == [], "the step's job outlived the stop and the link's return"
    else:
        codes = wait_exit({"hostB": c.torchruns["hostB"]}, timeout=30)
        timing("hostB's torchrun gone, after the cut", time.monotonic() - cut)
        assert codes["hostB"] not in (None, 0), f"hostB's torchrun: {codes}" + c.torchrun_logs()
        # hostA's nanny exits with 1 when a rank was lost, so its torchrun takes the failure path
        # at once (with 0 it would wait 300 s in its exit barrier for hostB's agent)
        codes = wait_exit({"hostA": c.torchruns["hostA"]}, timeout=15)
        assert codes["hostA"] not in (None, 0), f"hostA's torchrun: {codes}" + c.torchrun_logs()
    waited, left = c.wait_hosts_empty(GONE_S)
    assert not left, f"processes left in the hosts: {left}" + c.torchrun_logs()


@pytest.mark.parametrize("launcher", ["attach", "slurm"])
def test_a_healed_partition_leaves_nothing_behind(cluster: Cluster, launcher: str) -> None:
    """Issue 24: hostB's link cut during a cell (its rank reported lost), restored, then stop:
    the nanny that came back is told to end, and nothing is left within the orphan timeout + 5 s
    of the stop. The orphan timeout is longer than the cut, so that it is not what ends hostB."""
    c = cluster
    c.orphan_s = 15
    if launcher == "attach":
        c.start_attach()
    else:
        c.start_slurm(nodes=2, nproc=1)
    msg_id = c.nb.send("%%distributed\nimport time\nprint('waiting', flush=True)\ntime.sleep(600)")
    c.nb.wait_for_ranks(msg_id, "waiting", timeout=30)
    nanny_b = c.nannies("hostB")
    assert nanny_b, c.left_in_hosts()
    c.hosts.link_down("hostB")
    cut = time.monotonic()
    reply = c.nb.collect(msg_id, timeout=60)
    assert reply.status == "error" and "rank 1" in reply.text and "lost" in reply.text, reply.text
    c.hosts.link_up("hostB")
    healed = time.monotonic()
    timing(f"{launcher}: link restored, after the cut", healed - cut)
    # the nanny calls back (its heartbeat) and is told to end: before its orphan timeout
    left_b = c.wait_nannies_gone("hostB", c.orphan_s + GONE_S)
    timing(f"{launcher}: hostB's nanny gone, after the link came back", time.monotonic() - healed)
    assert not left_b, f"hostB's nanny outlived its orphan timeout after the link came back: {c.left_in_hosts()}"
    still = c.python(SESSION + "print('LOST', [r.rank for r in group.ranks if not r.alive])")
    assert "LOST [1]" in still, still  # lost stays lost: the rank did not come back as if alive
    stopped, took = c.stop()
    timing(f"{launcher}: stop after the healed partition", took)
    waited, left = c.wait_hosts_empty(c.orphan_s + GONE_S)
    timing(f"{launcher}: hosts empty, after the stop", took + waited)
    assert not left, f"processes left in the hosts after stop: {left}" + c.torchrun_logs()
    if launcher == "slurm":
        assert c.hosts.wait_no_jobs(timeout=15) == [], "the step's job outlived the stop"
    else:
        codes = wait_exit(c.torchruns, timeout=15)
        assert None not in codes.values(), f"torchrun still running: {codes}" + c.torchrun_logs()


@pytest.mark.parametrize("launcher", ["attach", "slurm"])
def test_sigkill_of_the_notebook_kernel_leaves_nothing_on_the_hosts(cluster: Cluster, launcher: str) -> None:
    c = cluster
    if launcher == "attach":
        c.start_attach()
    else:
        c.start_slurm(nodes=2, nproc=1)
    assert all(c.nannies(h) for h in HOSTS)
    os.kill(c.nb.pid, signal.SIGKILL)
    waited, left = c.wait_hosts_empty(ORPHAN_S + GONE_S + 20)
    timing(f"{launcher}: hosts empty after the notebook kernel's SIGKILL", waited)
    assert not left, f"processes outlived the notebook by {waited:.0f} s: {left}" + c.torchrun_logs()
    assert waited <= ORPHAN_S + GONE_S, f"the hosts emptied only {waited:.1f} s after the notebook died"
    if launcher == "attach":
        codes = wait_exit(c.torchruns, timeout=5)
        assert None not in codes.values(), codes
    else:
        assert c.hosts.wait_no_jobs(timeout=15) == [], "the orphaned srun step's job did not end"


def test_interrupt_reaches_a_rank_on_host_b_and_a_stuck_one_is_shown(cluster: Cluster) -> None:
    c = cluster
    c.start_attach()
    msg_id = c.nb.send("%%distributed\nimport time\nprint('in', flush=True)\nif rank == 1:\n    time.sleep(600)")
    c.nb.wait_for_ranks(msg_id, "in", timeout=30)
    time.sleep(0.5)  # rank 1 is in its sleep
    t0 = time.monotonic()
    c.nb.km.interrupt_kernel()
    reply = c.nb.collect(msg_id, timeout=60)
    timing("interrupt of a rank on hostB (cell returned)", time.monotonic() - t0)
    assert reply.status == "error", reply.text
    assert "---- rank 1 ----" in reply.text and "KeyboardInterrupt" in reply.text, reply.text
    assert "did not return" not in reply.text, reply.text

    # a collective that can never complete across the hosts: rank 0 waits for rank 1, asleep on
    # hostB; the interrupt frees rank 0 by aborting the group, formed again through the rendezvous
    # store on hostA (issue 34), and every rank keeps its variables
    msg_id = c.nb.send("%%distributed\nimport time, torch, torch.distributed as dist\nkept = rank + 1\n"
                       "print('in', flush=True)\nif rank == 1:\n    time.sleep(600)\nelse:\n"
                       "    dist.all_reduce(torch.ones(2))\n")
    c.nb.wait_for_ranks(msg_id, "in", timeout=30)
    time.sleep(0.5)
    c.nb.km.interrupt_kernel()
    hung = c.nb.collect(msg_id, timeout=90)
    assert "the group was aborted and formed again" in hung.text, hung.text
    after = c.nb.run("%%distributed\nt = torch.ones(1) * kept\ndist.all_reduce(t)\nprint(t.item())\n", timeout=60)
    assert after.status == "ok" and all(lines_of(after.text, r) == ["3.0"] for r in (0, 1)), after.text
    # rank 1 on hostB killed during a collective: rank 0 keeps its variables; rank 1's nanny starts a
    # fresh kernel for it on hostB and the group forms again at the same size
    died = c.nb.run("%%distributed\nimport os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                    "dist.all_reduce(torch.ones(8))\n", timeout=90)
    assert died.status == "error" and "rank 1 died" in died.text and "rank 0 kept its variables" in died.text, died.text
    back = c.nb.run("%clorch restart --ranks 1", timeout=120)
    assert back.status == "ok" and "rank 1 started afresh" in back.text, back.text
    fresh = c.nb.run("%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
                     "dist.all_reduce(t)\nprint(t.item(), 'kept' in dir())\n", timeout=60)
    assert lines_of(fresh.text, 0) == ["2.0 True"] and lines_of(fresh.text, 1) == ["2.0 False"], fresh.text
    refused = c.nb.run("%clorch restart --ranks 0", timeout=60)  # rank 0 serves the store: refused, nothing changes
    assert refused.status == "error" and "rendezvous store" in refused.text, refused.text
    status = c.nb.run("%clorch status")
    assert "degraded" not in status.text and "recovering" not in status.text, status.text

    code = ("%%distributed\nimport signal, time\nprint('in', flush=True)\n"
            "if rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(600)\n")
    msg_id = c.nb.send(code)
    c.nb.wait_for_ranks(msg_id, "in", timeout=30)
    time.sleep(0.5)
    c.nb.km.interrupt_kernel()
    stuck = c.nb.collect(msg_id, timeout=60)
    assert stuck.status == "error", stuck.text
    assert "rank 1 did not return" in stuck.text, stuck.text
    # rank 1's stack, fetched by its nanny on hostB: at its sleep, line 5 of the cell
    assert "line 5 in <module>" in stuck.text and "time.sleep(600)" in stuck.text, stuck.text
    # the verdict and the evidence name each rank's host, as the death reports do
    assert re.search(r"Why:.*rank 1 on hostB is at Cell In\[\d+\], line 5 in <module>",
                     " ".join(stuck.text.split())), stuck.text  # (wrapped at the cell's width)
    assert "---- rank 1 on hostB ----" in stuck.text, stuck.text
    again = c.nb.run("%clorch interrupt", timeout=60)
    assert again.status == "error" and "rank 1 did not return after the interrupt" in again.text, again.text
    assert "line 5 in <module>" in again.text, again.text
    restarted = c.nb.run("%clorch restart", timeout=120)
    assert restarted.status == "ok", restarted.text
    stopped, _ = c.stop()
    assert stopped.status == "ok", stopped.text
    assert wait_exit(c.torchruns, timeout=30) == {"hostA": 0, "hostB": 0}, c.torchrun_logs()
    _, left = c.wait_hosts_empty(GONE_S)
    assert not left, f"processes left after stop: {left}"


def test_no_secret_on_a_command_line_and_kernels_on_their_hosts_address(cluster: Cluster) -> None:
    c = cluster
    start = c.start_attach()
    connect_file = re.search(r"must read (\S+) \(0600", start.text).group(1)
    assert os.stat(connect_file).st_mode & 0o777 == 0o600
    with open(connect_file) as fh:
        token = json.load(fh)["token"]
    ranks = c.rank_info()
    secrets_ = {"the session's token": token}
    for r, rank in enumerate(ranks):
        info = rank["info"]
        assert info.get("curve_secretkey"), f"rank {r}'s kernel channels are not encrypted: {sorted(info)}"
        secrets_[f"rank {r}'s kernel Curve secret key"] = info["curve_secretkey"]
        secrets_[f"rank {r}'s kernel signing key"] = str(info["key"])
    found = []
    for pid in psutil.pids():
        line = cmdline(pid)
        found += [f"{what} in the command line of {pid} ({line[:80]})" for what, s in secrets_.items() if s in line]
    assert not found, found

    for r, host in enumerate(HOSTS):
        rank = ranks[r]
        assert rank["host"] == host and rank["info"]["ip"] == c.hosts.addr(host), rank
        pids = {rank["pid"], *(p.pid for p in psutil.Process(rank["pid"]).children(recursive=True))}
        ss = c.hosts.run_on_host(host, ["ss", "-Hltnp"], check=True).stdout
        mine = [line for line in ss.splitlines() if any(f"pid={p}," in line for p in pids)]
        assert len(mine) >= 5, f"rank {r}'s kernel (pid {rank['pid']}) listens on too few ports:\n{ss}"
        local = [line.split()[3] for line in mine]
        # the host's own address, or loopback (private to the host); never every interface
        wrong = [a for a in local if a.rpartition(":")[0] not in (c.hosts.addr(host), "127.0.0.1", "[::1]")]
        assert not wrong, (f"rank {r}'s kernel on {host} listens on {wrong}, not only on {c.hosts.addr(host)}:"
                           f"\n" + "\n".join(mine))
        nanny = c.nannies(host)
        assert not [line for line in ss.splitlines() if any(f"pid={p}," in line for p in nanny)], \
            f"the nanny on {host} listens; it should only connect out:\n{ss}"
    stopped, _ = c.stop()
    assert stopped.status == "ok", stopped.text
    assert wait_exit(c.torchruns, timeout=30) == {"hostA": 0, "hostB": 0}, c.torchrun_logs()


def test_a_forged_registration_fails_the_start_naming_its_host(cluster: Cluster, tmp_path) -> None:
    c = cluster
    msg_id, _ = c.send_attach(nodes=2, nproc=1)
    text = wait_text(c.nb, msg_id, "must read", timeout=30)
    connect_file = re.search(r"must read (\S+) \(0600", text).group(1)
    with open(connect_file) as fh:
        forged = json.load(fh)
    forged["token"] = "x" * len(forged["token"])
    path = tmp_path / "forged-connect.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(forged, fh)
    env = dict(os.environ, CLORCH_CONNECT_FILE=str(path), RANK="0", WORLD_SIZE="2", LOCAL_RANK="0",
               LOCAL_WORLD_SIZE="1")
    t0 = time.monotonic()
    done = c.hosts.run_on_host("hostA", [sys.executable, "-m", "clorch_repl.rank"], env=env, timeout=60)
    reply = c.nb.collect(msg_id, timeout=60)
    timing("a forged registration refused (start failed)", time.monotonic() - t0)
    assert reply.status == "error", reply.text
    assert "wrong token" in reply.text and "hostA" in reply.text, reply.text
    assert done.returncode == 2 and "refused" in done.stderr, (done.returncode, done.stderr)
    assert not os.path.exists(connect_file), "a failed start left its connect file behind"
    status = c.nb.run("%clorch status")
    assert status.status == "ok" and "no ranks are running" in status.text, status.text
