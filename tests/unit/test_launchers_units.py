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
