"""Batch jobs started with clorch_repl.distributed.launch, seen from %clorch jobs and %clorch logs --job."""

from __future__ import annotations

from typing import Any

from IPython.utils.capture import capture_output


def test_jobs_and_their_logs_are_visible_from_the_magics(ip: Any) -> None:
    from clorch_repl import distributed as dist

    job = dist.launch(nproc_per_node=2, main="dist_workers:train_small", args={"steps": 3}, timeout_ms=120_000)
    failing = dist.launch(nproc_per_node=2, main="dist_workers:fail_one", timeout_ms=120_000,
                          args={"fail_rank": 1, "how": "raise", "others": "sleep"})
    job.wait()
    try:
        failing.wait()
    except Exception:
        pass
    with capture_output() as cap:
        ip.run_line_magic("clorch", "jobs")
    table = cap.outputs[-1].data["text/plain"]
    rows = {line.split()[0]: line for line in table.splitlines()[1:]}
    assert "succeeded" in rows[job.id] and "dist_workers:train_small" in rows[job.id]
    assert "failed" in rows[failing.id] and "rank 1" in rows[failing.id]
    with capture_output() as cap:
        ip.run_line_magic("clorch", f"logs 1 --job {job.id}")
    assert "rank 1 final loss" in cap.stdout
    with capture_output() as cap:
        result = ip.run_cell("%clorch logs 0 --job job-999")
    assert not result.success and "no job 'job-999'" in cap.stdout + cap.stderr
    assert "Traceback" not in cap.stdout + cap.stderr
