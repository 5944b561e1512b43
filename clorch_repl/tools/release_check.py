"""``clorch-release-check --mode cpu|gpu``: does this installation train end to end?

(Also ``python -m clorch_repl.release_check``.)

It runs what a user's first notebook session would run, on real ranks, and prints one line per
check: collectives, DDP backward, gradient accumulation, AMP overflow handling (and, on GPU,
float16/bfloat16 autocast, fused attention and a suspend and resume), checkpoints, an FSDP2 model's sharded checkpoint,
a worker failure, and that no process is left behind. The exit status is non-zero when anything failed, so CI can run ``--mode cpu``
(two gloo ranks, well under a minute) and a GPU host ``--mode gpu`` (one NCCL rank per GPU).

The rank-side checks run in a single launched job, each guarded on its own, so one failing check
does not hide the others.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["main", "run_checks", "CheckResult"]

#: what the launched job runs on every rank
TARGET = "clorch_repl.tools.release_check_ranks"


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    seconds: float


# -- driver -------------------------------------------------------------------------------------

def _timed(name: str, fn: Callable[[], str]) -> CheckResult:
    started = time.perf_counter()
    try:
        return CheckResult(name, True, fn(), time.perf_counter() - started)
    except Exception as exc:
        return CheckResult(name, False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                           time.perf_counter() - started)


class _Checks:
    """The checks of one run, sharing its ranks' launch arguments and the pids they saw (the
    last check looks for every one of them)."""

    def __init__(self, nproc: int, launch_kw: dict[str, Any], timeout_s: float, folder: str) -> None:
        self.nproc, self.launch_kw, self.timeout_ms, self.folder = nproc, launch_kw, int(timeout_s * 1000), folder
        self.pids: list[int] = []

    def rank_checks(self) -> list[CheckResult]:
        """One batch job runs :data:`RANK_CHECKS` on every rank: the launch row, then one row each."""
        from .. import distributed as dist

        started = time.perf_counter()
        try:
            job = dist.launch(main=f"{TARGET}:rank_checks", args={"folder": self.folder},
                              timeout_ms=self.timeout_ms, **self.launch_kw)
            self.pids.extend(p for p in job.pids() if p)
            with job:
                per_rank = job.wait()
        except Exception as exc:  # noqa: BLE001 - any failure to launch is this check's failed row
            return [CheckResult("launch", False, f"{type(exc).__name__}: {exc}"[:500], time.perf_counter() - started)]
        results = [CheckResult("launch", True, f"{self.nproc} rank(s) started, ran and exited",
                               time.perf_counter() - started)]
        from .release_check_ranks import RANK_CHECKS

        for i, (name, _fn) in enumerate(RANK_CHECKS):
            rows = [ranks[i] for ranks in per_rank]
            bad = [(r, row) for r, row in enumerate(rows) if not row["ok"]]
            detail = rows[0]["detail"] if not bad else f"rank {bad[0][0]}: {bad[0][1]['detail']}"
            results.append(CheckResult(name, not bad, detail, max(row["seconds"] for row in rows)))
        return results

    def worker_failure(self) -> str:
        from .. import distributed as dist
        from ..errors import RankFailure

        job = dist.launch(main=f"{TARGET}:failing_rank", timeout_ms=self.timeout_ms, **self.launch_kw)
        self.pids.extend(p for p in job.pids() if p)
        t0 = time.perf_counter()
        with job:
            try:
                job.wait()
            except RankFailure as exc:
                expected = self.nproc - 1
                assert exc.rank == expected, f"the failure was blamed on rank {exc.rank}, not {expected}"
                assert "injected failure" in str(exc), f"the error lacks the rank's message: {exc}"
                return f"rank {exc.rank}'s exception reported in {time.perf_counter() - t0:.1f}s"
        raise AssertionError("the job succeeded although a rank raised")

    def interactive_session(self) -> str:
        from ..session.engine import local_session

        nproc, backend = self.nproc, self.launch_kw["backend"]
        session = local_session(nproc, backend, self.launch_kw.get("devices"))  # the engine, as scripts drive it
        seconds = session.start()
        try:
            self.pids.extend(session.pids())
            code = ("import torch, torch.distributed as dist\n"
                    "t = torch.ones(1, device=device) * (rank + 1)\ndist.all_reduce(t)\n"
                    "assert t.item() == world_size * (world_size + 1) / 2, t")
            outcome = session.run(code, None, None, None)  # as a %%distributed cell runs it
            failed = [f"rank {o.rank}: {o.error.evalue if o.error else o.status.value}" for o in outcome.failed]
            assert outcome.ok, "the all_reduce cell failed: " + "; ".join(failed)
        finally:
            left = session.stop()
        assert not left, f"ranks still running after stop: {left}"
        return f"{nproc} worker kernel(s) formed a {backend} group in {seconds:.1f}s, ran an all_reduce cell, stopped"

    def suspend_resume(self) -> str:
        """gpu: one NCCL rank's tensors survive ``%clorch suspend`` (its GPU memory freed) and
        ``%clorch resume`` (issue 37); one rank, since two GPUs' suspend is the two-GPU issue's."""
        from .. import cuda
        from ..host import cuda_checkpoint
        from ..session.engine import local_session

        problem = cuda_checkpoint.api_problem()
        if problem:
            return f"skipped: {problem}"
        session = local_session(1, "nccl", [0])
        session.start()
        try:
            self.pids.extend(session.pids())
            pid = session.pids()[0]
            code = ("import torch\nx = torch.randn(2**28, device=device)\ns = x.double().sum().item()\n"
                    "torch.cuda.synchronize()")
            assert session.run(code, None, None, None).ok, "the cell that fills 1 GiB of GPU memory failed"
            t0 = time.perf_counter()
            session.suspend()
            out = time.perf_counter() - t0
            left = cuda.memory_by_pid().get(pid, 0)
            assert left < 2**28, f"rank 0 still holds {left} bytes of GPU memory while suspended"
            t0 = time.perf_counter()
            session.resume()
            back = time.perf_counter() - t0
            check = ("import torch.distributed as dist\nassert x.double().sum().item() == s\n"
                     "t = torch.ones(1, device=device)\ndist.all_reduce(t)\nassert t.item() == 1")
            assert session.run(check, None, None, None).ok, "after the resume the tensor or the group was wrong"
        finally:
            left_over = session.stop()
        assert not left_over, f"ranks still running after stop: {left_over}"
        return f"1 NCCL rank with 1 GiB: suspended in {out:.1f}s (GPU memory freed), resumed in {back:.1f}s, exact"

    def cleanup(self) -> str:
        from ..common.procs import wait_gone

        left = wait_gone(self.pids, 15.0)
        assert not left, f"processes still running after their jobs ended: {left}"
        return f"all {len(self.pids)} rank processes are gone"


def run_checks(mode: str = "cpu", nproc: int | None = None, timeout_s: float = 180.0) -> list[CheckResult]:
    """Every check, in order; never raises for a failed check (it is a failed row instead)."""
    from .. import cuda

    results: list[CheckResult] = []
    gpus = cuda.device_count()
    if mode == "gpu":
        if gpus == 0:
            return [CheckResult("gpu available", False, "no usable CUDA device (check the driver, "
                                "CUDA_VISIBLE_DEVICES, and that torch is a CUDA build)", 0.0)]
        nproc = nproc or gpus
        launch_kw: dict[str, Any] = {"nproc_per_node": nproc, "devices": list(range(nproc)), "backend": "nccl"}
        results.append(CheckResult("gpu available", True, f"{gpus} GPU(s); using {nproc} NCCL rank(s)", 0.0))
    else:
        nproc = nproc or 2
        launch_kw = {"nproc_per_node": nproc, "backend": "gloo"}
    folder = tempfile.mkdtemp(prefix="clorch-release-check-")
    try:
        checks = _Checks(nproc, launch_kw, timeout_s, folder)
        results.extend(checks.rank_checks())
        results.append(_timed("worker failure", checks.worker_failure))
        results.append(_timed("interactive session", checks.interactive_session))
        if mode == "gpu":
            results.append(_timed("suspend and resume", checks.suspend_resume))
        results.append(_timed("process cleanup", checks.cleanup))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def format_table(results: list[CheckResult]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  result  time     detail", f"{'-' * width}  ------  -------  ------"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {'PASS' if r.ok else 'FAIL':<6}  {r.seconds:6.2f}s  {r.detail}")
    failed = sum(not r.ok for r in results)
    lines.append(f"{len(results) - failed} passed, {failed} failed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="clorch-release-check",
                                     description="Check a clorch_repl installation end to end.")
    parser.add_argument("--mode", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: gloo CPU ranks (CI); gpu: one NCCL rank per GPU")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (cpu default 2; gpu default every GPU)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds allowed for each job")
    ns = parser.parse_args(argv)
    if ns.nproc is not None and ns.nproc < 1:
        parser.error("--nproc must be at least 1")
    import torch

    print(f"clorch_repl release check: mode {ns.mode}, torch {torch.__version__}, "
          f"Python {platform.python_version()}, {platform.system()} {platform.machine()}", flush=True)
    started = time.perf_counter()
    results = run_checks(ns.mode, ns.nproc, ns.timeout)
    print(format_table(results))
    print(f"total {time.perf_counter() - started:.1f}s")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
