"""One suite over every launcher (after ipyparallel's tests/test_launcher.py): the contract of
:class:`clorch_repl.launchers.base.Launcher`, driven through the relay alone, with no notebook
and no IPython shell: real rank kernels, a real gloo group, real interrupts and deaths.

``local``: children of this process. ``attach``: two ranks started by a real torchrun on this
host that call back over CurveZMQ to 127.0.0.1 (the multi-host path without the network; across
simulated hosts and Slurm: tests/integration/test_multihost.py). ``procs``: a launcher from outside the
package (tests/plugins), found through the ``clorch_repl.launchers`` entry-point group as a
plugin's would be, and written only to the documented hooks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any, Iterator

import pytest

from clorch_repl.launchers.base import LaunchOptions, Launcher
from clorch_repl.common.procs import free_port
from clorch_repl.session.protocol import CellRequest, RankOutput, Status
from clorch_repl.session.relay import Relay
from clorch_repl.wire import PROTOCOL_VERSION
from clorch_repl.wire.requests import request_code
from clorch_repl.session.sink import PlainSink
from clorch_repl.common.topology import remote_topology, resolve_topology
from plugin_path import with_plugins, without_plugins


class Collect(PlainSink):
    """An output sink that keeps each rank's stream text."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}

    def output(self, item: RankOutput) -> None:
        if item.kind == "stream":
            self.text[item.rank] = self.text.get(item.rank, "") + item.content["text"]


class Started:
    def __init__(self, launcher: Launcher, runner: subprocess.Popen[bytes] | None) -> None:
        self.launcher, self.runner = launcher, runner
        self.relay: Relay | None = None

    def connect(self) -> Relay:
        self.launcher.launch(lambda _: None)
        self.relay = Relay(self.launcher)
        self.relay.connect(lambda k, n: None)
        joined = self.relay.execute(CellRequest(request_code("join", protocol=PROTOCOL_VERSION), (0, 1), timeout_s=120), silent=True)
        # each failed rank's own words (pytest's repr of the whole outcome cut them short: a fresh
        # .ci/run's attach join failed with an OSError whose message was lost)
        assert joined.ok, [(o.rank, o.status.value, o.error.ename if o.error else None,
                            o.error.evalue if o.error else o.exit) for o in joined.failed]
        return self.relay

    def run(self, code: str, **kwargs: Any) -> tuple[Any, Collect]:
        assert self.relay is not None
        sink = Collect()
        return self.relay.execute(CellRequest(code, (0, 1), **kwargs), sink), sink

    def restart(self) -> Relay:
        assert self.relay is not None
        self.relay.close()
        assert self.launcher.stop(5.0) == []
        return self.connect()


def _local() -> Started:
    return Started(__import__("clorch_repl.launchers.local", fromlist=["LocalLauncher"]).LocalLauncher(
        resolve_topology(2, backend="gloo")), None)


def _attach() -> Started:
    from clorch_repl.launchers.attach import AttachLauncher

    options = LaunchOptions(nodes=1, nproc_per_node=2, listen="127.0.0.1", start_timeout_s=60)
    launcher = AttachLauncher(remote_topology(options, "gloo", None, launcher="attach"), options)
    launcher.begin = lambda progress: None  # the command it would print is run right here instead
    runner = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts",
         "0", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "clorch_repl.rank"],
        env=dict(os.environ, CLORCH_CONNECT_FILE=launcher.connect_file), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)
    return Started(launcher, runner)


def _procs() -> Started:
    from clorch_repl.launchers.registry import launcher_class

    with_plugins()
    cls = launcher_class("procs")
    options = LaunchOptions(nodes=1, nproc_per_node=2, listen="127.0.0.1", start_timeout_s=60)
    return Started(cls(cls.topology(options, nproc=None, devices=None, backend="gloo", timeout=None), options), None)


STARTERS = {"local": _local, "attach": _attach, "procs": _procs}


@pytest.fixture(params=sorted(STARTERS))
def started(request: pytest.FixtureRequest) -> Iterator[Started]:
    s = STARTERS[request.param]()
    try:
        s.connect()
        yield s
    finally:
        if s.relay is not None:
            s.relay.close()
        s.launcher.stop(5.0)
        s.launcher.close()
        without_plugins()
        if s.runner is not None:
            assert s.runner.wait(timeout=30) == 0  # stop and close let torchrun end cleanly


def test_cells_run_in_the_group_and_state_persists(started: Started) -> None:
    outcome, out = started.run("import torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\n"
                               "dist.all_reduce(t)\nprint('sum', t.item(), flush=True)\nkeep = rank")
    assert outcome.ok and out.text == {0: "sum 3.0\n", 1: "sum 3.0\n"}
    outcome, out = started.run("print('kept', keep)")
    assert out.text == {0: "kept 0\n", 1: "kept 1\n"}


def test_interrupt_and_a_stack_dump_reach_a_rank_blocked_in_a_cell(started: Started) -> None:
    launcher = started.launcher
    stacks: list[str] = []
    threading.Timer(1.5, lambda: stacks.append(launcher.dump_stack(1))).start()
    threading.Timer(2.5, launcher.interrupt).start()
    outcome, _ = started.run("import time\nfor _ in range(600):\n    time.sleep(0.1)")
    assert {o.status for o in outcome.ranks.values()} == {Status.INTERRUPTED}
    assert stacks and "line 3 in <module>" in stacks[0], stacks


def test_the_log_holds_what_a_rank_printed_and_a_death_is_reported(started: Started) -> None:
    started.run("import sys\nprint('to-the-log', rank, flush=True)")
    assert "to-the-log 1" in started.launcher.log_tail(1, 50)
    outcome, _ = started.run("import os, sys\nif rank == 1:\n    print('last words', flush=True)\n"
                             "    sys.stdout.flush(); os._exit(7)")
    dead = outcome.ranks[1]
    assert dead.status is Status.DIED and dead.exit.startswith("exit code 7"), dead
    assert "last words" in started.launcher.death_report(1)
    assert not started.launcher.ranks[1].alive and started.launcher.ranks[0].alive


def test_restart_gives_fresh_ranks_in_the_same_place(started: Started) -> None:
    started.run("secret = 42")
    started.restart()
    outcome, out = started.run("print('secret' in globals(), rank)")
    assert outcome.ok and out.text == {0: "False 0\n", 1: "False 1\n"}


def test_connection_info_builds_the_clients_the_debugger_and_relay_use(started: Started) -> None:
    """The debugger panel's forwarder builds an AsyncKernelClient from connection_info(session=True),
    as from a KernelManager's: it must accept the rank's info (Curve keys included, remote)."""
    from jupyter_client.asynchronous import AsyncKernelClient

    for handle in started.launcher.ranks:
        client = AsyncKernelClient(**handle.connection_info(session=True))
        assert client.session.key and client.shell_port
