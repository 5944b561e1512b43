"""An empty ``%%distributed`` cell on called-back ranks (CurveZMQ over TCP) beside local ranks (IPC).

    python benchmarks/remote_cell.py [--iters 200] [--rounds 3]

Two sessions in two notebook kernels, measured in the same run and interleaved round by round:
``--launcher local`` (2 ranks, IPC sockets) and ``--launcher attach`` (2 ranks started by a real
torchrun on this host that call back to 127.0.0.1: the path of ranks on other hosts, with Curve
encryption on every kernel channel, minus the network itself). Prints each round's p50 and the
ratio remote/local (median of the rounds, with min and max). Target (issue 8): within 1.2x.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from cell_latency import time_cells  # noqa: E402
from notebook_kernel import NotebookKernel  # noqa: E402

EMPTY = "%%distributed\npass"


def local_session() -> NotebookKernel:
    nb = NotebookKernel()
    assert nb.run("%load_ext clorch_repl").status == "ok"
    assert nb.run("%clorch start --nproc 2 --backend gloo").status == "ok"
    return nb


def remote_session() -> tuple[NotebookKernel, subprocess.Popen[bytes]]:
    from clorch_repl.common.procs import free_port

    nb = NotebookKernel()
    assert nb.run("%load_ext clorch_repl").status == "ok"
    msg_id = nb.send("%clorch start --launcher attach --nodes 1 --nproc-per-node 2 --listen 127.0.0.1")
    nb.wait_for_output(msg_id, "CLORCH_CONNECT_FILE=", timeout=60)
    text = "".join(m["content"].get("text", "") for m in nb._held if m["msg_type"] == "stream")
    path = re.search(r"CLORCH_CONNECT_FILE=(\S+)", text).group(1)
    runner = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                               "2", "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                               f"127.0.0.1:{free_port()}", "-m", "clorch_repl.rank"],
                              env=dict(os.environ, CLORCH_CONNECT_FILE=path), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    assert nb.collect(msg_id, timeout=120).status == "ok"
    return nb, runner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    local = local_session()
    remote, runner = remote_session()
    ratios, locals_, remotes = [], [], []
    try:
        for i in range(args.rounds):
            order = [("local", local), ("remote", remote)] if i % 2 == 0 else [("remote", remote), ("local", local)]
            p50 = {}
            for name, nb in order:
                p50[name] = statistics.median(time_cells(nb, EMPTY, args.iters)) * 1e3
            locals_.append(p50["local"])
            remotes.append(p50["remote"])
            ratios.append(p50["remote"] / p50["local"])
            print(f"round {i + 1}: local {p50['local']:.2f} ms, remote {p50['remote']:.2f} ms, "
                  f"ratio {ratios[-1]:.3f}", flush=True)
        print(f"empty cell, 2 ranks, p50 over {args.iters} cells x {args.rounds} rounds: local (IPC) "
              f"{statistics.median(locals_):.2f} ms [{min(locals_):.2f}-{max(locals_):.2f}], called back "
              f"(CurveZMQ/TCP) {statistics.median(remotes):.2f} ms [{min(remotes):.2f}-{max(remotes):.2f}]; "
              f"ratio {statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}] (target <= 1.2)")
    finally:
        for nb in (local, remote):
            nb.run("%clorch stop")
            nb.shutdown()
        runner.wait(timeout=30)


if __name__ == "__main__":
    main()
