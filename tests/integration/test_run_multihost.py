"""``%clorch run`` through ``--launcher slurm``: the tests' own torchrun scripts on ranks that srun
started on the two simulated hosts of tests/cluster.py (network namespaces, a real two-node Slurm
cluster; root). The hosts share this filesystem, as cluster nodes share a home or project folder:
the script's path is the same on both. The notebook kernel and its clean-up are test_multihost's."""

from __future__ import annotations

import os

import pytest

from cluster import two_hosts, two_hosts_clean  # noqa: F401
from clorch_repl.kernel.torchrun import KEPT_NOTE
from rank_text import lines_of
from test_multihost import GONE_S, Cluster, cluster  # noqa: F401

pytestmark = pytest.mark.hosts

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchrun_scripts")


def test_a_torchrun_script_runs_on_slurm_ranks_of_two_hosts(cluster: Cluster, tmp_path: object) -> None:
    c = cluster
    start = c.start_slurm(nodes=2, nproc=1)
    assert "ranks called back 2/2 (hosts: hostA, hostB)" in start.text, start.text

    report = c.nb.run(f"%clorch run {os.path.join(SCRIPTS, 'report.py')} --flag", timeout=60)
    assert report.status == "ok", report.text
    for r in (0, 1):
        assert lines_of(report.text, r)[:3] == [
            "name __main__", "argv report.py --flag",
            f"env RANK={r} LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 GROUP_RANK={r} GROUP_WORLD_SIZE=2 "
            f"ROLE_RANK={r} ROLE_WORLD_SIZE=2 TORCHELASTIC_RUN_ID=clorch"], report.text
    assert "[rank 1 hostB] env RANK=1" in report.text, report.text

    snap = os.path.join(str(tmp_path), "snap.pt")
    ddp = os.path.join(SCRIPTS, "ddp_resume.py")
    for epochs, first in ((2, "epoch 0"), (3, "resumed from epoch 1")):
        trained = c.nb.run(f"%clorch run {ddp} --epochs {epochs} --snapshot {snap}", timeout=120)
        assert trained.status == "ok", trained.text
        shown = [[line for line in lines_of(trained.text, r) if not line.startswith(KEPT_NOTE)] for r in (0, 1)]
        assert all(lines[0].startswith(first) for lines in shown), trained.text
    weights = [[line for line in lines_of(trained.text, r) if line.startswith("weights")] for r in (0, 1)]
    assert len(weights[0]) == 1 and weights[0] == weights[1], trained.text

    after = c.nb.run("%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
                     "dist.all_reduce(t)\nprint('sum', t.item())", timeout=60)
    assert after.status == "ok" and all(lines_of(after.text, r) == ["sum 2.0"] for r in (0, 1)), after.text

    missing = c.nb.run("%clorch run /nowhere/train.py", timeout=60)
    assert missing.status == "error", missing.text
    said = " ".join(missing.text.split())  # its words: a refusal is wrapped at the cell's width
    assert "nothing was run" in said and "on host hostA" in said and "on host hostB" in said, missing.text

    stopped, _ = c.stop()
    assert stopped.status == "ok", stopped.text
    assert c.hosts.wait_no_jobs(timeout=15) == []
    _, left = c.wait_hosts_empty(GONE_S)
    assert not left, f"processes left after stop: {left}"
