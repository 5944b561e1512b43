"""The simulated-hosts fixture (tests/cluster.py) proven with plain commands, not clorch_repl.

The multi-host tests of clorch_repl trust this fixture to behave like two machines and a Slurm
cluster: each host has its own name and address, reaches the other and the notebook over TCP, can
be cut off and reconnected, runs a two-node torchrun/gloo job, and Slurm places one task on each.
After every test no process may be left in either host (the two_hosts_clean fixture checks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from cluster import HOSTS, TwoHosts, two_hosts, two_hosts_clean  # noqa: F401

pytestmark = pytest.mark.hosts

# A TCP listener: prints "listening" once bound, then answers each connection with its hostname.
LISTENER = textwrap.dedent(
    """
    import socket, sys
    srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.sendall(socket.gethostname().encode())
        conn.close()
    """
)
# A client: connects by name (or address) within a timeout, prints what the listener said.
CONNECT = textwrap.dedent(
    """
    import socket, sys
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
        print(c.recv(100).decode(), flush=True)
    """
)
PORT = 40123


def start_listener(hosts: TwoHosts, host: str | None, bind: str, port: int = PORT) -> subprocess.Popen:
    """A listener on host (None: the notebook's root namespace), ready when this returns."""
    argv = [sys.executable, "-u", "-c", LISTENER, bind, str(port)]
    opts = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.Popen(argv, **opts) if host is None else hosts.on_host(host, argv, **opts)
    line = proc.stdout.readline()
    if line.strip() != "listening":
        proc.kill()
        where = host or "the notebook"
        raise AssertionError(f"listener on {where} did not start: {proc.stderr.read()}")
    return proc


def connect(
    hosts: TwoHosts, host: str, target: str, port: int = PORT, timeout: float = 3
) -> subprocess.CompletedProcess:
    """Connect from host to target:port; rc 0 and the listener's hostname on stdout when it works."""
    argv = [sys.executable, "-c", CONNECT, target, str(port), str(timeout)]
    return hosts.run_on_host(host, argv, timeout=30)


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=10)


def test_each_host_has_its_name_and_address(two_hosts_clean: TwoHosts) -> None:
    hosts = two_hosts_clean
    for host in HOSTS:
        done = hosts.run_on_host(host, ["sh", "-c", "hostname; ip -o -4 addr show dev eth0"], check=True)
        name, addr_line = done.stdout.splitlines()
        assert name == host
        assert f" {hosts.addr(host)}/24 " in addr_line


def test_srun_places_one_task_on_each_host(two_hosts_clean: TwoHosts) -> None:
    hosts = two_hosts_clean
    assert hosts.sinfo() == {"hostA": "idle", "hostB": "idle"}
    done = subprocess.run(["srun", "-N2", "-n2", "hostname"], env=hosts.slurm_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["hostA", "hostB"]
    # The nodes run the project's Python (same filesystem), each in its host's network.
    code = "import socket, sys, torch; print(socket.gethostname(), sys.prefix == sys.base_prefix)"
    done = subprocess.run(["srun", "-N2", "-n2", sys.executable, "-c", code], env=hosts.slurm_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["hostA False", "hostB False"]
    assert hosts.wait_no_jobs() == []


def test_hosts_reach_each_other_and_the_notebook(two_hosts_clean: TwoHosts) -> None:
    hosts = two_hosts_clean
    on_b = start_listener(hosts, "hostB", hosts.addr("hostB"))
    on_notebook = start_listener(hosts, None, hosts.notebook_addr)
    try:
        assert on_b.pid in hosts.processes_in("hostB")
        assert on_notebook.pid not in hosts.processes_in("hostA") + hosts.processes_in("hostB")
        by_name = connect(hosts, "hostA", "hostB")
        assert (by_name.returncode, by_name.stdout.strip()) == (0, "hostB"), by_name.stderr
        by_addr = connect(hosts, "hostA", hosts.addr("hostB"))
        assert (by_addr.returncode, by_addr.stdout.strip()) == (0, "hostB"), by_addr.stderr
        nb = connect(hosts, "hostA", "nbhost")
        assert (nb.returncode, nb.stdout.strip()) == (0, os.uname().nodename), nb.stderr
    finally:
        stop(on_b)
        stop(on_notebook)


def test_link_down_cuts_a_host_off_and_link_up_restores_it(two_hosts_clean: TwoHosts) -> None:
    hosts = two_hosts_clean
    on_b = start_listener(hosts, "hostB", hosts.addr("hostB"))
    try:
        assert connect(hosts, "hostA", "hostB").returncode == 0
        hosts.link_down("hostB")
        start = time.monotonic()
        cut = connect(hosts, "hostA", "hostB", timeout=2)
        assert cut.returncode != 0 and cut.stdout == ""
        assert "timed out" in cut.stderr or "unreachable" in cut.stderr.lower(), cut.stderr
        print(f"connect to a cut host failed after {time.monotonic() - start:.1f} s")
        hosts.link_up("hostB")
        back = connect(hosts, "hostA", "hostB", timeout=10)
        assert (back.returncode, back.stdout.strip()) == (0, "hostB"), back.stderr
    finally:
        hosts.link_up("hostB")
        stop(on_b)


ALL_REDUCE = textwrap.dedent(
    """
    import os, socket
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    rank, size = dist.get_rank(), dist.get_world_size()
    print(f"{socket.gethostname()} rank {rank} of {size} sum {t.item():g}", flush=True)
    dist.destroy_process_group()
    """
)


def test_torchrun_across_the_two_hosts(two_hosts_clean: TwoHosts, tmp_path) -> None:
    hosts = two_hosts_clean
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "hostA:29400", "--rdzv-id", "fixture",
        "--max-restarts", "0", str(script),
    ]
    procs = {
        h: hosts.on_host(h, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for h in HOSTS
    }
    outs = {}
    try:
        for h, p in procs.items():
            out, err = p.communicate(timeout=180)
            outs[h] = (p.returncode, out, err)
    finally:
        # On failure or ^C: torchrun passes SIGTERM on to its worker (a SIGKILL would orphan it).
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
    for h, (rc, out, err) in outs.items():
        assert rc == 0, f"torchrun on {h} exited {rc}: {err[-2000:]}"
        lines = [line for line in out.splitlines() if " sum " in line]
        assert len(lines) == 1 and lines[0].startswith(f"{h} rank ") and lines[0].endswith(
            "of 2 sum 3"
        ), out
    ranks = sorted(outs[h][1].split(" rank ")[1].split()[0] for h in HOSTS)
    assert ranks == ["0", "1"]
