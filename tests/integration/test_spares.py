"""Warm spares (``%clorch start --spares 1``): a restart after a rank's death and after a hang makes
the spares the ranks, in fresh processes with empty namespaces and a working group; the next set
is started; the spares cost what ``%clorch status`` says; a spare that died, or a change to the
notebook's environment since the spares started, means a cold start; and no spare outlives
``%clorch stop``, an interrupted restart or the notebook kernel's SIGKILL. Where spares are the
default (GPUs, or ``CLORCH_SPARES=1`` as here), ``%load_ext`` warms a set for the first start. Real notebook
kernel, real rank kernels, real gloo groups (spares are the default on GPUs only; the GPU case is
tests/gpu/test_gpu_spares.py)."""

from __future__ import annotations

import os
import re
import signal
import time

import psutil

from clorch_repl.common.procs import wait_gone
from notebook_kernel import NotebookKernel, clorch_session
from rank_text import lines_of

WHO = "%%distributed\nimport os\nprint(os.getpid(), 'marker' in globals())\nmarker = rank"
GROUP = "%%distributed\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nprint(t.item())"


def spare_pids(nb: NotebookKernel, count: int = 2, timeout: float = 60.0) -> list[int]:
    """The warm spares' pids from ``%clorch status``, once ``count`` of them are ready."""
    deadline = time.monotonic() + timeout
    while True:
        text = nb.run("%clorch status").text
        found = re.search(r"warm spares for the next %clorch restart: (\d+) \(pids ([\d, ]+)\), ready, "
                          r"(\S+ \S+) resident", text)
        if found and int(found.group(1)) == count:
            return [int(p) for p in found.group(2).split(", ")]
        assert time.monotonic() < deadline, f"no {count} warm spares within {timeout} s:\n{text}"
        time.sleep(0.5)


def rank_pids(nb: NotebookKernel, n: int = 2) -> dict[int, tuple[int, bool]]:
    """rank -> (pid, whether its namespace already had the marker), and sets the marker."""
    reply = nb.run(WHO)
    assert reply.status == "ok", reply.text
    out = {}
    for r in range(n):
        (line,) = lines_of(reply.text, r)
        pid, seen = line.split()
        out[r] = (int(pid), seen == "True")
    return out


def below(pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(pid).children(recursive=True)]


def test_restarts_after_a_death_and_a_hang_take_the_warm_spares() -> None:
    with clorch_session("--nproc 2 --spares 1", stop=False) as nb:
        first = rank_pids(nb)
        spares = spare_pids(nb)
        assert not set(spares) & {pid for pid, _ in first.values()}

        died = nb.run("%%distributed --ranks 1\nimport os; os._exit(3)", timeout=60)
        assert died.status == "error" and "rank 1 died" in died.text, died.text
        t0 = time.monotonic()
        restarted = nb.run("%clorch restart", timeout=120)
        took = time.monotonic() - t0
        assert restarted.status == "ok" and "2 warm spare rank(s) taken" in restarted.text, restarted.text
        after = rank_pids(nb)
        assert [after[r][0] for r in (0, 1)] == spares, "the ranks are the spares' processes"
        assert not any(seen for _, seen in after.values()), "a fresh namespace on every rank"
        group = nb.run(GROUP)
        assert group.status == "ok" and lines_of(group.text, 0) == lines_of(group.text, 1) == ["3.0"], group.text
        log = nb.run("%clorch logs 1 --tail 0").text
        assert log.count("--- clorch_repl: rank 1 starting at") == 2, log
        # the promoted spare's start-up and then its output are in the rank's log, after its banner
        current = log.rsplit("--- clorch_repl: rank 1 starting at", 1)[1]
        assert "--- clorch_repl: spare for rank 1 starting at" in current, log
        assert re.search(rf"^{spares[1]} False$", current, re.M), log
        print(f"restart after a death with warm spares (gloo, 2 ranks): {took:.2f} s")

        second = spare_pids(nb)  # the next set, started once the group had formed
        assert not set(second) & set(spares)
        hung = nb.run("%%distributed --timeout 2\nimport torch.distributed as dist\nif rank == 0: dist.barrier()",
                      timeout=60)
        assert hung.status == "error", hung.text
        t0 = time.monotonic()
        assert nb.run("%clorch restart", timeout=120).status == "ok"
        took = time.monotonic() - t0
        after = rank_pids(nb)
        assert [after[r][0] for r in (0, 1)] == second and not any(seen for _, seen in after.values())
        assert nb.run(GROUP).status == "ok"
        print(f"restart after a hang with warm spares (gloo, 2 ranks): {took:.2f} s")

        # what the notebook changed since the spares started reaches the ranks: they start cold
        spare_pids(nb)
        assert nb.run("import os\nos.environ['CLORCH_PROBE'] = 'new'").status == "ok"
        restarted = nb.run("%clorch restart", timeout=120)
        assert "the environment changed since the warm spares started (CLORCH_PROBE); starting the ranks cold" \
            in restarted.text, restarted.text
        assert restarted.text.count("the environment changed") == 1, restarted.text  # said once
        probe = nb.run("%%distributed\nimport os\nprint(os.environ.get('CLORCH_PROBE'))")
        assert lines_of(probe.text, 0) == lines_of(probe.text, 1) == ["new"], probe.text

        # a spare that died before it was needed: the restart starts the ranks cold instead
        third = spare_pids(nb)
        os.kill(third[0], signal.SIGKILL)
        assert wait_gone([third[0]], 10) == []
        assert nb.run("%clorch restart", timeout=120).status == "ok"
        after = rank_pids(nb)
        assert not {pid for pid, _ in after.values()} & set(third)
        assert nb.run(GROUP).status == "ok"
        fourth = spare_pids(nb)
        everything = below(nb.pid)
        assert set(fourth) <= set(everything)
        stopped = nb.run("%clorch stop")
        assert stopped.status == "ok", stopped.text
        assert wait_gone(everything, 15) == [], "a rank or spare outlived %clorch stop"
        assert wait_gone([third[1]], 5) == [], "the surviving spare of the dead one's set was left"


def test_an_interrupted_restart_leaves_no_spare_or_rank_behind() -> None:
    with clorch_session("--nproc 2 --spares 1", stop=False) as nb:
        spare_pids(nb)
        # the ranks take their time to leave (a polite stop waits for them), and Ctrl-C lands then
        assert nb.run("%%distributed\nimport atexit, time\natexit.register(time.sleep, 8)").status == "ok"
        everything = below(nb.pid)
        msg_id = nb.send("%clorch restart")
        time.sleep(0.7)
        nb.km.interrupt_kernel()
        reply = nb.collect(msg_id, timeout=60)
        assert reply.status == "error" and "the restart was interrupted" in reply.text, reply.text
        assert "Traceback" not in reply.text and "nothing is left running" in reply.text, reply.text
        assert wait_gone(everything, 15) == [], "a rank or spare outlived the interrupted restart"
        assert below(nb.pid) == []
        assert nb.run("%clorch stop").text.strip() == "clorch: no ranks are running"
        assert nb.run("%clorch start --nproc 2 --spares 0").status == "ok"
        assert nb.run(GROUP).status == "ok"


def test_no_spare_outlives_the_notebook_kernel_even_after_sigkill() -> None:
    with clorch_session("--nproc 2 --spares 1", stop=False) as nb:
        spares = spare_pids(nb)
        everything = below(nb.pid)
        assert set(spares) <= set(everything) and len(everything) >= 8  # 2 ranks, 2 spares, supervisors
        os.kill(nb.pid, signal.SIGKILL)
        assert wait_gone(everything, 15) == [], "a spare, rank or supervisor outlived the notebook kernel"


def test_cpu_sessions_keep_no_spares_unless_asked() -> None:
    with clorch_session("--nproc 2", stop=False) as nb:
        # The launcher's own decision (no spare wanted, none kept), then what it does: the workers
        # below the notebook are watched for 3 s and must stay the ranks' own two the whole time
        # (a look after a sleep would pass just as well if the spare came later or went earlier).
        decided = nb.run("from clorch_repl.magics import magics_for\n"
                         "_g = magics_for(get_ipython()).session.group\n"
                         "print('WANTED', _g.spares_wanted, 'SPARES', len(_g.spares))\ndel _g").text
        assert "WANTED 0 SPARES 0" in decided, decided
        seen = set()
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            kernels = worker_pids(nb)
            assert len(kernels) == 2, f"{kernels} below the notebook: the ranks' own two and a spare"
            seen.update(kernels)
            time.sleep(0.2)
        assert len(seen) == 2, seen  # none came and went in between either
        status = nb.run("%clorch status").text
        assert "warm spares" not in status and "backend" in status, status  # the table, without spares
        first = rank_pids(nb)
        assert nb.run("%clorch restart").status == "ok"
        after = rank_pids(nb)
        assert not {p for p, _ in after.values()} & {p for p, _ in first.values()}
        assert not any(seen for _, seen in after.values())


def worker_pids(nb: NotebookKernel) -> list[int]:
    """The rank kernels and spares below the notebook kernel (not their supervisors)."""
    return sorted(p.pid for p in psutil.Process(nb.pid).children(recursive=True)
                  if p.cmdline()[1:3] == ["-m", "clorch_repl.kernel.app"])


def wait_for_workers(nb: NotebookKernel, count: int, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(found := worker_pids(nb)) != count:
        assert time.monotonic() < deadline, f"{found} below the notebook kernel, not {count} workers"
        time.sleep(0.2)
    return found


def test_loading_warms_spares_that_the_first_start_takes() -> None:
    nb = NotebookKernel(env={"CLORCH_SPARES": "1"})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        warm = wait_for_workers(nb, 2)
        status = nb.run("%clorch status")
        assert status.status == "ok" and "no ranks are running; warm spares for the first %clorch start: 2" \
            in status.text, status.text
        started = nb.run("%clorch start")  # 2 CPU ranks: the topology the spares were warmed for
        assert started.status == "ok" and "2 warm spare rank(s) taken" in started.text, started.text
        # finding the topology imported no torch into the notebook kernel (seconds with a CUDA build)
        assert nb.run("import sys\nprint('torch' in sys.modules)").text.strip() == "False"
        after = rank_pids(nb)
        assert sorted(pid for pid, _ in after.values()) == warm and not any(seen for _, seen in after.values())
        assert nb.run(GROUP).status == "ok"
        assert len(spare_pids(nb)) == 2  # and the next set, for a restart
        everything = below(nb.pid)
        assert nb.run("%clorch stop").status == "ok"
        assert wait_gone(everything, 15) == [] and below(nb.pid) == []
    finally:
        nb.shutdown()


def test_warm_spares_of_another_topology_unload_or_death_leave_nothing() -> None:
    nb = NotebookKernel(env={"CLORCH_SPARES": "1"})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        warm = wait_for_workers(nb, 2)
        stopped = nb.run("%clorch stop")  # before any start: it ends what the load warmed
        assert "ended the 2 warm spare(s) made when the extension loaded" in stopped.text, stopped.text
        assert wait_gone(warm, 10) == []
        assert nb.run("%unload_ext clorch_repl\n%load_ext clorch_repl").status == "ok"
        warm = wait_for_workers(nb, 2)
        started = nb.run("%clorch start --nproc 1 --spares 0")
        assert started.status == "ok" and "ended the 2 warm spare(s) made when the extension loaded (--spares 0)" \
            in started.text and "taken" not in started.text, started.text
        assert wait_gone(warm, 10) == [], "spares warmed for 2 ranks outlived a start of 1"
        assert nb.run("%clorch stop").status == "ok"
        assert nb.run("%unload_ext clorch_repl\n%load_ext clorch_repl").status == "ok"
        warm = wait_for_workers(nb, 2)
        everything = below(nb.pid)
        assert nb.run("%unload_ext clorch_repl").status == "ok"
        assert wait_gone(everything, 10) == [], "warm spares outlived %unload_ext"
        assert nb.run("%load_ext clorch_repl").status == "ok"
        wait_for_workers(nb, 2)
        everything = below(nb.pid)
        os.kill(nb.pid, signal.SIGKILL)
        assert wait_gone(everything, 15) == [], "warm spares outlived the notebook kernel's SIGKILL"
    finally:
        nb.shutdown()


def test_a_healthy_restart_lets_the_ranks_exit_cleanly(tmp_path) -> None:
    """A restart of an idle, healthy group stops it politely (its atexit handlers, buffered files
    and unfinished threads are not lost, though the rank skips the interpreter's teardown:
    clorch_repl.kernel.quick_exit); only a dead, hung or busy group is ended at once."""
    with clorch_session("--nproc 2 --spares 1", stop=False) as nb:
        spare_pids(nb)
        marks = [tmp_path / f"exit-{r}" for r in (0, 1)]
        code = (f"%%distributed\nimport atexit, pathlib\nf = open(r'{tmp_path}/buffered-' + str(rank), 'w')\n"
                "f.write('kept')  # buffered: only a clean exit flushes it\n"
                f"atexit.register(lambda: pathlib.Path(r'{tmp_path}/exit-' + str(rank)).write_text('ran'))\n"
                "import threading, time\n"  # a thread still writing when the stop comes: an exit waits for it
                f"threading.Thread(target=lambda r=rank: (time.sleep(0.5), pathlib.Path(r'{tmp_path}/thread-' + "
                "str(r)).write_text('done'))).start()")
        assert nb.run(code).status == "ok"
        restarted = nb.run("%clorch restart", timeout=120)
        assert restarted.status == "ok" and "warm spare rank(s) taken" in restarted.text, restarted.text
        assert all(m.exists() for m in marks), "a healthy restart skipped the ranks' atexit handlers"
        assert [(tmp_path / f"buffered-{r}").read_text() for r in (0, 1)] == ["kept", "kept"]
        assert [(tmp_path / f"thread-{r}").read_text() for r in (0, 1)] == ["done", "done"]


def test_a_failed_restart_after_a_warm_start_does_not_break_the_next_one() -> None:
    nb = NotebookKernel(env={"CLORCH_SPARES": "1"})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"
        wait_for_workers(nb, 2)
        assert nb.run("%clorch start").status == "ok"
        # ranks that cannot start: the environment changed, so the restart is cold, and it fails
        assert nb.run("import os\nos.environ['PYTHONHOME'] = '/nonexistent'").status == "ok"
        failed = nb.run("%clorch restart", timeout=120)
        assert failed.status == "error", failed.text
        assert nb.run("del os.environ['PYTHONHOME']").status == "ok"
        again = nb.run("%clorch restart", timeout=120)
        assert again.status == "ok", again.text
        assert nb.run(GROUP).status == "ok"
    finally:
        nb.shutdown()


#: In the notebook kernel: the first warm spare made rank 1 is SIGKILLed just after the launcher
#: found it alive, before it joins. The window (between the launcher's look and the join) is too
#: short to hit from outside, so the launcher's own step is wrapped; the process and its death are real.
KILL_SPARE_ON_PROMOTION = """
import os, signal
from clorch_repl.launchers.local import LocalLauncher
_promote = LocalLauncher._promote
def _promote_and_kill(self, spare, _done=[]):
    _promote(self, spare)
    if spare.rank == 1 and not _done:
        _done.append(spare.pid)
        os.kill(spare.pid, signal.SIGKILL)
LocalLauncher._promote = _promote_and_kill
"""


def test_a_spare_that_dies_while_joining_is_replaced_by_a_cold_start() -> None:
    with clorch_session("--nproc 2 --spares 1", stop=False) as nb:
        rank_pids(nb)
        spares = spare_pids(nb)
        assert nb.run(KILL_SPARE_ON_PROMOTION).status == "ok"
        restarted = nb.run("%clorch restart", timeout=120)
        assert restarted.status == "ok", restarted.text
        assert re.search(r"the warm spare made rank 1 \(killed by signal SIGKILL.*\) ended while joining; "
                         r"starting the ranks cold", restarted.text), restarted.text
        after = rank_pids(nb)
        assert not {pid for pid, _ in after.values()} & set(spares), "cold ranks, not the spares"
        assert not any(seen for _, seen in after.values())
        group = nb.run(GROUP)
        assert group.status == "ok" and lines_of(group.text, 0) == lines_of(group.text, 1) == ["3.0"], group.text
        assert wait_gone(spares, 10) == [], "the other spare of the broken set was left"
        spare_pids(nb)  # the next set is warmed as after any start
        everything = below(nb.pid)
        assert nb.run("%clorch stop").status == "ok"
        assert wait_gone(everything, 15) == [], "a rank or spare outlived %clorch stop"


def test_a_bad_clorch_spares_is_refused_and_leaves_no_file(tmp_path) -> None:
    nb = NotebookKernel(env={"CLORCH_SPARES": "x", "TMPDIR": str(tmp_path)})
    try:
        assert nb.run("%load_ext clorch_repl").status == "ok"  # loading never fails for it
        started = nb.run("%clorch start")
        assert started.status == "error" and "CLORCH_SPARES='x' in the environment must be 0" in started.text
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("clorch-")] == []
        assert below(nb.pid) == []
    finally:
        nb.shutdown()


#: In the notebook kernel: at each promotion of a spare, which processes of the old ranks (their
#: kernels and supervisors, the whole trees' roots) still run. A wrapper of the launcher's own
#: step, which it then takes; nothing is simulated.
RECORD_PROMOTIONS = """
from clorch_repl.launchers.local import LocalLauncher
from clorch_repl.magics import magics_for
from clorch_repl.common.procs import pid_running
_old = [pid for p in magics_for(get_ipython()).session.group.ranks for pid in (p.pid, p.supervisor_pid)]
_alive_at_promotion = []
_promote = getattr(LocalLauncher, '_unrecorded_promote', LocalLauncher._promote)
LocalLauncher._unrecorded_promote = _promote
def _recording_promote(self, spare):
    _alive_at_promotion.append([pid for pid in _old if pid_running(pid)])
    _promote(self, spare)
LocalLauncher._promote = _recording_promote
"""


def test_a_restart_makes_spares_ranks_only_once_the_old_ranks_are_gone() -> None:
    """The point a restart waits for (issue 39): every process of the old ranks has exited
    before a spare is made a rank. On GPUs the driver frees a rank's memory when its process
    exits, and a spare made a rank creates its CUDA context as it joins: a new rank must not
    meet the old one's memory on its GPU. And the old kernel's last words (its atexit output)
    belong before the new kernel's banner in the rank's log. Both after a polite stop (a healthy
    group) and after one at once (a dead rank)."""
    with clorch_session("--nproc 2 --spares 1", stop=False) as nb:
        for before in (None, "%%distributed --ranks 1\nimport os; os._exit(3)"):
            spare_pids(nb)
            rank_pids(nb)
            assert nb.run(RECORD_PROMOTIONS).status == "ok"
            if before:
                assert nb.run(before, timeout=60).status == "error"
            restarted = nb.run("%clorch restart", timeout=120)
            assert restarted.status == "ok" and "2 warm spare rank(s) taken" in restarted.text, restarted.text
            seen = nb.run("print(_alive_at_promotion)").text.strip()
            assert seen == "[[], []]", f"old ranks' processes still running as spares were made ranks: {seen}"
            assert nb.run(GROUP).status == "ok"


def test_a_spare_is_ready_only_once_its_kernel_serves_requests(tmp_path, monkeypatch) -> None:
    """A kernel binds its sockets before it builds its shell and runs its start-up code; a spare
    taken "ready" by its sockets made a restart wait that out in its connect (0.35 s on the GPU
    host, issue 39). Here every kernel's IPython start-up sleeps 4 s: while the spare's sockets
    exist and it sleeps, ``%clorch status``'s figures (spare_usage) do not count it ready; once it
    serves, it answers, the restart takes it and the ended rank's marker is removed. Through the
    engine, gloo, one rank."""
    from jupyter_client.connect import port_names

    from clorch_repl.wire import serving
    from clorch_repl.session.engine import CellHooks, local_session

    startup = tmp_path / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-slow.py").write_text("import time\ntime.sleep(4)\n")
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    monkeypatch.setenv("CLORCH_SPARES", "1")
    session = local_session(1, "gloo")
    session.start()
    try:
        launcher = session.group
        deadline = time.monotonic() + 60
        while not launcher.spares or launcher.spares[0].pid is None or not all(
                os.path.exists(f"{info['ip']}-{info[name]}") for info in [launcher.spares[0].connection_info()]
                for name in port_names):
            assert time.monotonic() < deadline, "the spare never bound its sockets"
            time.sleep(0.02)
        spare = launcher.spares[0]
        # bound, and still in its 4-second start-up
        assert not serving.is_serving(spare.manager.connection_file)
        assert [ready for _, _, ready in launcher.spare_usage()] == [False]
        while not all(ready for _, _, ready in launcher.spare_usage()):
            assert time.monotonic() < deadline, "the spare never said it serves"
            time.sleep(0.05)
        client = spare.client()
        client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        try:
            assert client.kernel_info(reply=True, timeout=10)["content"]["status"] == "ok"
        finally:
            client.stop_channels()
        said: list[str] = []
        old = serving.serving_path(launcher.ranks[0].manager.connection_file)
        assert os.path.exists(old)  # the cold rank's, which serves
        session.restart(said.append)
        assert "1 warm spare rank(s) taken" in said, said
        assert not os.path.exists(old), "the ended rank's .serving file was left behind"
        assert session.run("import os; print(os.getpid())", None, None, CellHooks()).ok
        assert session.group.ranks[0].pid == spare.pid
    finally:
        assert session.stop() == []
