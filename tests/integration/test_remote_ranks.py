"""Ranks that call back (``--launcher attach``), on this one host: real torchrun, real nannies
(``python -m clorch_repl.rank``), real kernels over TCP with CurveZMQ, driven from a real notebook
kernel. Needs no root: the callback endpoint listens on 127.0.0.1. The same path across simulated
hosts (network namespaces) and under a real Slurm cluster: tests/integration/test_multihost.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import psutil
import pytest

from clorch_repl.common.procs import wait_gone
from notebook_kernel import NotebookKernel
from rank_text import lines_of

START = "%clorch start --launcher attach --nodes 1 --nproc-per-node 2 --listen 127.0.0.1 --start-timeout 60"


def torchrun(connect_file: str, nproc: int = 2) -> subprocess.Popen[bytes]:
    """The printed command, as a user runs it on the node (here: this host)."""
    from clorch_repl.common.procs import free_port

    port = free_port()
    env = dict(os.environ, CLORCH_CONNECT_FILE=connect_file)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node",
                             str(nproc), "--max-restarts", "0", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             f"127.0.0.1:{port}", "-m", "clorch_repl.rank"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def begin_start(nb: NotebookKernel, extra: str = "") -> tuple[str, str]:
    """Load the extension and send the attach start; returns its msg_id and the connect file's
    path from the command it printed (the start then waits for the ranks)."""
    assert nb.run("%load_ext clorch_repl").status == "ok"
    msg_id = nb.send(START + extra)
    return msg_id, printed_connect_file(nb, msg_id)


def printed_connect_file(nb: NotebookKernel, msg_id: str) -> str:
    """Wait for the start's printed command and take the connect file's path from it."""
    nb.wait_for_output(msg_id, "CLORCH_CONNECT_FILE=", timeout=60)
    text = "".join(m["content"].get("text", "") for m in nb._held if m["msg_type"] == "stream")
    return re.search(r"CLORCH_CONNECT_FILE=(\S+)", text).group(1)


class Attached:
    def __init__(self, nb: NotebookKernel, runner: subprocess.Popen[bytes], connect_file: str, token: str):
        self.nb, self.runner, self.connect_file, self.token = nb, runner, connect_file, token


@contextlib.contextmanager
def attached_session(extra: str = "") -> Iterator[Attached]:
    """A notebook kernel whose attach start (with ``extra`` options) was answered by the printed
    torchrun command on this host; afterwards the kernel's shutdown and torchrun's end."""
    nb = NotebookKernel()
    runner = None
    try:
        msg_id, path = begin_start(nb, extra)
        with open(path) as fh:
            token = json.load(fh)["token"]
        assert os.stat(path).st_mode & 0o777 == 0o600
        runner = torchrun(path)
        reply = nb.collect(msg_id, timeout=120)
        assert reply.status == "ok", reply.text
        yield Attached(nb, runner, path, token)
    finally:
        nb.shutdown()
        if runner is not None and runner.poll() is None:
            runner.terminate()  # torchrun passes it on to the nannies
            runner.wait(timeout=30)


@pytest.fixture()
def attached() -> Iterator[Attached]:
    with attached_session() as session:
        yield session


def test_attach_runs_cells_across_the_called_back_ranks_and_stop_ends_torchrun(attached: Attached) -> None:
    nb = attached.nb
    reply = nb.run("%%distributed\nimport torch, torch.distributed as dist, socket\n"
                   "t = torch.ones(2) * (rank + 1)\ndist.all_reduce(t)\nprint(t.tolist(), world_size)")
    assert reply.status == "ok", reply.text
    assert lines_of(reply.text, 0) == ["[3.0, 3.0] 2"] and lines_of(reply.text, 1) == ["[3.0, 3.0] 2"]
    host = os.uname().nodename
    assert f"[ranks 0-1 {host}] [3.0, 3.0] 2" in reply.text or f"[rank 1 {host}] [3.0, 3.0] 2" in reply.text
    status = nb.run("%clorch status").text
    host = os.uname().nodename
    # memory read by each rank's nanny on its host
    assert re.search(rf"^0\s+{re.escape(host)}\s+idle\s+\d+\s+cpu\s+gloo\s+[\d.]+ MiB", status, re.M), status
    assert re.search(rf"^1\s+{re.escape(host)}\s+idle\s+\d+\s+cpu\s+gloo\s+[\d.]+ MiB", status, re.M), status
    logs = nb.run("%clorch logs 1 --tail 0")  # read on the rank's host by its nanny
    assert logs.status == "ok" and "--- clorch_repl: rank 1 starting at" in logs.text, logs.text
    t0 = time.monotonic()
    stopped = nb.run("%clorch stop")
    assert stopped.status == "ok", stopped.text
    # the nannies exit, so torchrun's agent (no elastic restart) exits at once with success
    assert attached.runner.wait(timeout=20) == 0
    assert time.monotonic() - t0 < 15


def test_a_remote_kernels_death_names_the_rank_and_restart_reuses_the_nannies(attached: Attached) -> None:
    nb = attached.nb
    nannies = [p for p in psutil.Process(attached.runner.pid).children(recursive=True)
               if "clorch_repl.rank" in " ".join(p.cmdline())]
    assert len(nannies) == 2
    reply = nb.run("%%distributed --ranks 1\nimport os, signal\nos.kill(os.getpid(), signal.SIGKILL)", timeout=60)
    assert reply.status == "error"
    assert "rank 1" in reply.text and "SIGKILL" in reply.text, reply.text
    assert attached.runner.poll() is None  # the nanny stayed: torchrun did not tear the world down
    t0 = time.monotonic()
    restarted = nb.run("%clorch restart")
    assert restarted.status == "ok", restarted.text
    took = time.monotonic() - t0
    ok = nb.run("%%distributed\nprint('again', rank)")
    assert ok.status == "ok" and lines_of(ok.text, 1) == ["again 1"], ok.text
    assert all(p.is_running() for p in nannies), "the same nannies serve the fresh kernels"
    print(f"restart of 2 called-back ranks: {took:.1f} s")


def test_interrupt_reaches_a_remote_rank_and_a_stuck_one_shows_its_stack(attached: Attached) -> None:
    nb = attached.nb
    msg_id = nb.send("%%distributed\nimport signal, time\nprint('in', flush=True)\n"
                     "if rank == 1:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n    time.sleep(600)\n"
                     "else:\n    time.sleep(600)\n")
    nb.wait_for_ranks(msg_id, "in")
    time.sleep(0.5)
    nb.km.interrupt_kernel()
    reply = nb.collect(msg_id, timeout=60)
    assert reply.status == "error"
    assert "KeyboardInterrupt" in reply.text  # rank 0's
    assert "rank 1 did not return" in reply.text and "time.sleep(600)" in reply.text, reply.text
    assert nb.run("%clorch restart").status == "ok"


def test_no_secret_on_any_command_line_and_kernels_listen_on_one_address(attached: Attached) -> None:
    with open(attached.connect_file) as fh:
        info = json.load(fh)
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        assert info["token"] not in line and info["server_key"] not in line, line
    kernels = [p for p in psutil.Process(attached.runner.pid).children(recursive=True)
               if p.cmdline()[1:3] == ["-m", "clorch_repl.kernel.app"]]  # not their supervisors
    assert len(kernels) == 2
    for kernel in kernels:
        listening = {c.laddr.ip for c in kernel.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
        assert listening == {"127.0.0.1"}, listening  # the host's address toward the notebook, never 0.0.0.0


def test_a_forged_registration_fails_the_start_naming_the_host(tmp_path) -> None:
    nb = NotebookKernel()
    try:
        msg_id, path = begin_start(nb)
        with open(path) as fh:
            info = json.load(fh)
        info["token"] = "not-the-token"
        fake = tmp_path / "connect.json"
        fake.write_text(json.dumps(info))
        env = dict(os.environ, CLORCH_CONNECT_FILE=str(fake), RANK="0", LOCAL_RANK="0", WORLD_SIZE="2",
                   LOCAL_WORLD_SIZE="2")
        forged = subprocess.run([sys.executable, "-m", "clorch_repl.rank"], env=env, capture_output=True,
                                text=True, timeout=60)
        reply = nb.collect(msg_id, timeout=60)
        assert reply.status == "error"
        assert "wrong token" in reply.text and os.uname().nodename in reply.text, reply.text
        assert forged.returncode == 2 and "refused" in forged.stderr, forged.stderr
        assert not os.path.exists(path)  # the failed start removed its connect file
    finally:
        nb.shutdown()


def test_nannies_end_their_kernels_when_the_notebook_is_killed() -> None:
    with attached_session(" --orphan-timeout 3") as session:
        nb, runner, path = session.nb, session.runner, session.connect_file
        below = [p.pid for p in psutil.Process(runner.pid).children(recursive=True)]
        assert len(below) >= 6  # 2 nannies, their supervisors and kernels
        t0 = time.monotonic()
        os.kill(nb.pid, signal.SIGKILL)
        assert wait_gone(below, 3 + 5) == []
        assert runner.wait(timeout=10) is not None  # torchrun's workers exited (status 3: orphaned)
        # the dead notebook could not remove its connect file; the next start on this host does
        from clorch_repl.launchers.callback import remove_stale, remove_stale_connect_files

        assert os.path.exists(path)
        remove_stale_connect_files(os.path.dirname(path))
        assert not os.path.exists(path)
        left = [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"clorch-{os.uname().nodename}-{nb.pid}-")]
        assert len(left) == 1  # the dead notebook's private directory, until the next start on this host
        remove_stale(tempfile.gettempdir(), "clorch")
        assert not os.path.exists(os.path.join(tempfile.gettempdir(), left[0]))
        print(f"every rank process gone {time.monotonic() - t0:.1f} s after the notebook's SIGKILL")


def test_a_start_nobody_answers_names_the_missing_ranks_and_leaves_nothing(ip) -> None:
    from IPython.core.error import UsageError

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(UsageError) as info:
        ip.run_line_magic("clorch", "start --launcher attach --nodes 1 --nproc-per-node 2 --listen 127.0.0.1 "
                                    "--start-timeout 2")
    said = " ".join(str(info.value).split())  # its words: the message is wrapped at the cell's width
    assert "ranks 0-1 never called back within 2 s" in said, str(info.value)
    assert "check that the nodes can reach 127.0.0.1:" in said
    path = re.search(r"read the connect file (\S+)", said).group(1)
    assert not os.path.exists(path)  # the failed start removed its private directory
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_connect_file_of_another_session_is_named_at_once(tmp_path) -> None:
    """Its key is not the endpoint's: the encrypted handshake fails, which ZeroMQ would retry
    forever in silence; the nanny says why and exits instead of waiting for its orphan timeout."""
    import zmq

    from clorch_repl.launchers.callback import CallbackServer

    server = CallbackServer("127.0.0.1", 0, str(tmp_path / "live.json"), 1, orphan_timeout_s=60)
    try:
        stale = json.loads((tmp_path / "live.json").read_text())
        stale["server_key"] = zmq.curve_keypair()[0].decode()  # an ended session's key, say
        (tmp_path / "stale.json").write_text(json.dumps(stale))
        env = dict(os.environ, CLORCH_CONNECT_FILE=str(tmp_path / "stale.json"), RANK="0", WORLD_SIZE="1")
        env.pop("CLORCH_CONNECT", None)
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "clorch_repl.rank"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2, done.stderr
        assert "the connect file's key is not that endpoint's" in done.stderr, done.stderr
        assert time.monotonic() - t0 < 20  # not the 60 s orphan timeout
        assert not server.peers
    finally:
        server.close()


def _spare_workers(runner: subprocess.Popen[bytes]) -> set[int]:
    """The warm spare kernels below torchrun's nannies (their environment says CLORCH_SPARE)."""
    found = set()
    for p in psutil.Process(runner.pid).children(recursive=True):
        try:
            if p.cmdline()[1:3] == ["-m", "clorch_repl.kernel.app"] and p.environ().get("CLORCH_SPARE"):
                found.add(p.pid)
        except psutil.Error:
            continue
    return found


def test_a_remote_restart_takes_the_nannies_warm_spares() -> None:
    with attached_session(" --spares 1") as session:
        nb, runner = session.nb, session.runner
        deadline = time.monotonic() + 60
        while len(spares := _spare_workers(runner)) != 2:
            assert time.monotonic() < deadline, "the nannies started no warm spares"
            time.sleep(0.2)
        died = nb.run("%%distributed --ranks 1\nimport os; os._exit(3)", timeout=60)
        assert died.status == "error" and "rank 1" in died.text, died.text
        t0 = time.monotonic()
        assert nb.run("%clorch restart", timeout=120).status == "ok"
        took = time.monotonic() - t0
        reply = nb.run("%%distributed\nimport os, torch, torch.distributed as dist\nt = torch.ones(1)\n"
                       "dist.all_reduce(t)\nprint(os.getpid(), 'marker' in globals(), t.item())")
        assert reply.status == "ok", reply.text
        lines = [lines_of(reply.text, r)[0].split() for r in (0, 1)]
        assert {int(pid) for pid, _, _ in lines} == spares, (spares, reply.text)
        assert all(seen == "False" and total == "2.0" for _, seen, total in lines), reply.text
        log = nb.run("%clorch logs 1 --tail 0").text
        assert "--- clorch_repl: spare for rank 1 starting at" in log.rsplit("--- clorch_repl: rank 1 starting at", 1)[1]
        print(f"restart of 2 called-back ranks from warm spares: {took:.2f} s")
        assert nb.run("%clorch stop").status == "ok"
        assert runner.wait(timeout=20) == 0
