"""What ``job.status()`` answers: frozen snapshots of a batch job and its ranks (no process in them).

``JOB_STATES`` and ``RANK_STATES`` are every state they can be in.
"""

from __future__ import annotations

from dataclasses import dataclass

JOB_STATES = ("running", "succeeded", "failed", "timed_out", "stopped")
RANK_STATES = ("running", "succeeded", "failed", "stopped")


@dataclass(frozen=True)
class RankStatus:
    """One rank as ``job.status()`` sees it. ``error`` is the rank's first error line, if any."""

    rank: int
    pid: int | None
    device: str
    state: str
    exit_code: int | None
    exit: str
    error: str | None


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of a job. ``message`` is one line: the cause when it failed or timed out."""

    id: str
    state: str
    main: str
    backend: str
    nproc: int
    elapsed_s: float
    message: str
    first_failed_rank: int | None
    ranks: tuple[RankStatus, ...]

    def summary(self) -> str:
        """One line for a table of jobs (``%clorch jobs``)."""
        text = f"{self.id}  {self.state:<9}  {self.nproc} x {self.backend}  {self.main}  {self.elapsed_s:.1f}s"
        return f"{text}  {self.message}" if self.message else text
