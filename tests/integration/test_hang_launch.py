"""A launch() job that times out in a hang says why: the verdict names the collective, the ranks
waiting in it and the line of the rank that never called it (real gloo ranks, real processes)."""

from __future__ import annotations

import re

import pytest

from clorch_repl import distributed as dist


def test_a_job_timing_out_in_a_hang_names_the_rank_and_line() -> None:
    job = dist.launch(nproc_per_node=2, backend="gloo", main="hang_scenarios:job_skips_barrier",
                      timeout_ms=8_000, pg_timeout_s=60)
    with pytest.raises(dist.JobTimeout) as info:
        job.wait(60)
    message = str(info.value)
    # The job's own all_reduce is #1 after the group's set-up collectives, whatever their count:
    # the barrier is the next one.
    m = re.search(r"why: barrier #(\d+) \(default group\): rank 0 waits in it; rank 1 never called it and is at "
                  r"\S*hang_scenarios\.py:(\d+) in load_batch_forever\(\)", message)
    assert m, message
    assert "all_reduce #" in message and "float32[16]" in message  # the evidence: rank 0's last collectives
