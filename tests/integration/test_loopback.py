"""Ranks of a batch job listen on loopback only (the rendezvous store included)."""

from __future__ import annotations

import time

import psutil

from clorch_repl import distributed as dist


def test_launched_ranks_listen_on_loopback_only() -> None:
    with dist.launch(nproc_per_node=2, main="dist_workers:chatty_then_sleep", timeout_ms=120_000) as job:
        deadline = time.monotonic() + 60
        while not all(f"READY {r}" in job.logs(r) for r in (0, 1)):
            assert time.monotonic() < deadline, job.logs(0)
            time.sleep(0.1)
        listening = [c.laddr.ip for pid in job.pids() if pid
                     for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and set(listening) <= {"127.0.0.1", "::1"}, listening
