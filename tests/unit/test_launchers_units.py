"""The launcher registry without ranks: a plugin launcher (tests/plugins) is listed and batch jobs
say where they can run; a launcher written before the topology hook says so. The suite over every
launcher with real ranks: tests/integration/test_launchers.py."""

from __future__ import annotations

import pytest

from clorch_repl.launchers.base import LaunchOptions, Launcher
from plugin_path import with_plugins, without_plugins


def test_a_plugin_launcher_is_listed_and_batch_jobs_say_where_they_can_run() -> None:
    from clorch_repl import distributed as dist
    from clorch_repl.errors import ConfigError
    from clorch_repl.launchers.registry import names

    assert "procs" not in names()
    with_plugins()
    try:
        assert names() == ["attach", "local", "procs", "slurm"]
        for name in ("procs", "attach"):  # neither names a JobRanks: ranks started outside clorch_repl
            with pytest.raises(ConfigError, match=f"the '{name}' launcher cannot run batch jobs .* "
                                                  "launcher='local' or 'slurm'"):
                dist.launch(2, main="dist_workers:ok", launcher=name, backend="gloo")
    finally:
        without_plugins()
    with pytest.raises(ConfigError, match="launcher must be 'local' or 'slurm'; got 'mpi'"):
        dist.launch(2, main="dist_workers:ok", launcher="mpi")


def test_a_launcher_written_before_the_topology_hook_says_so() -> None:
    from clorch_repl.errors import ConfigError

    class Older(Launcher):  # the hooks an earlier plugin had, and no topology()
        name = "older"

    with pytest.raises(ConfigError, match=r"the launcher 'older' \(.*Older\) does not say what ranks a start gives"):
        Older.topology(LaunchOptions(), nproc=None, devices=None, backend=None, timeout=None)


# ------------------------------------------------------- the local launcher's look at its ranks' deaths
class _Process:
    """A forked rank's process handle (ForkedProcess) over a pipe standing in for its pidfd (the
    pipe's read end is readable once the write end has something: the process "exited")."""

    def __init__(self, fd: int, exits_once_read: bool = False) -> None:
        self._fd = fd
        self.returncode: int | None = None
        self._exits_once_read = exits_once_read

    @property
    def exit_fd(self) -> int | None:
        if self.returncode is not None:
            return None
        fd = self._fd
        if self._exits_once_read:  # another thread learns of the exit (and closes the pidfd) right after
            self.returncode = -9
        return fd


class _Rank:
    def __init__(self, rank: int, process: _Process | None, dead: bool = False) -> None:
        self.rank, self.process, self.returncode, self._dead = rank, process, None, dead
        self.asked = 0

    @property
    def alive(self) -> bool:  # each rank's own look (through jupyter_client's provisioner)
        self.asked += 1
        return not self._dead


def test_the_local_launchers_one_look_asks_only_the_ranks_it_cannot_answer_for() -> None:
    import os

    from clorch_repl.launchers.local_rank import ended

    quiet_r, quiet_w = os.pipe()
    other_r, other_w = os.pipe()
    woke_r, woke_w = os.pipe()
    closed_r, closed_w = os.pipe()
    os.write(woke_w, b"x")
    try:
        ranks = [_Rank(0, _Process(quiet_r)), _Rank(1, _Process(woke_r), dead=True), _Rank(2, None, dead=True),
                 _Rank(3, _Process(closed_r, exits_once_read=True), dead=True), _Rank(4, _Process(other_r))]
        assert ended(ranks) == [1, 2, 3]  # type: ignore[arg-type]
        # the quiet ones were answered by the one poll; the woken one, the one without a pidfd and the
        # one whose exit became known while the poll was made (its number may name another file) were asked
        assert [r.asked for r in ranks] == [0, 1, 1, 1, 0]
    finally:
        for fd in (quiet_r, quiet_w, other_r, other_w, woke_r, woke_w, closed_r, closed_w):
            os.close(fd)
