"""A batch job's folder outlives a SIGKILLed notebook kernel only until the next launch.

A real notebook kernel launches two small jobs (CPU, gloo): one in clorch's own temporary folder,
one in a ``log_dir`` the user named (the temporary directory itself, so that its folder looks like
clorch's own). The kernel is SIGKILLed after they ended: nothing runs that could remove the
folders. A second notebook kernel launches a job; that launch sweeps the first kernel's folder and
nothing else: not the user's ``log_dir`` folder, not a folder a process still names (a rank that
may still run), not one whose owner lives, not a symlink; a folder naming a live pid with another
start time (a reused pid) is swept. The decision alone: tests/unit/test_job_dirs_units.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any


from clorch_repl.common.procs import pid_running
from clorch_repl.jobs import job_dirs
from clorch_repl.jobs.job_dirs import OWNER_FILE
from notebook_kernel import NotebookKernel, Reply


def launch(extra: str = "") -> str:
    """A small job's launch, as a notebook cell writes it."""
    return ('dist.launch(nproc_per_node=2, backend="gloo", main="tests.dist_workers:train_small", '
            f'args={{"steps": 2}}, timeout_ms=120_000{extra})')


LAUNCH = f"""
import json, tempfile
from clorch_repl import distributed as dist
job = {launch()}
kept = {launch(", log_dir=tempfile.gettempdir()")}
job.wait(); kept.wait()
print(json.dumps({{"job": job.dir, "kept": kept.dir, "states": [job.state, kept.state]}}))
"""
CAPTURE = """
import logging
class Seen(logging.Handler):
    def __init__(self): super().__init__(); self.lines = []
    def emit(self, record): self.lines.append(record.getMessage())
seen = Seen()
logging.getLogger("clorch_repl.jobs.job_dirs").addHandler(seen)
logging.getLogger("clorch_repl.jobs.job_dirs").setLevel(logging.DEBUG)
from clorch_repl import distributed as dist
"""
SECOND = f"""
import json
job = {launch()}
values = job.wait()
print(json.dumps({{"dir": job.dir, "state": job.state, "losses": len(values[0]["losses"]), "log": seen.lines}}))
seen.lines.clear()
"""


def ok(reply: Reply) -> Reply:
    assert reply.status == "ok", reply.text
    return reply


def printed(reply: Reply) -> dict[str, Any]:
    return json.loads(ok(reply).text.strip().splitlines()[-1])


def make(root: str, name: str, record: dict[str, Any]) -> str:
    path = os.path.join(root, name)
    os.mkdir(path, 0o700)
    with open(os.path.join(path, OWNER_FILE), "w") as fh:
        json.dump(record, fh)
    return path


def test_a_killed_notebooks_job_folder_is_swept_by_the_next_launch(tmp_path: Any) -> None:
    tmpdir_env = str(tmp_path / "tmp")  # the notebook kernels' TMPDIR: this test's alone
    os.mkdir(tmpdir_env)
    env = {"TMPDIR": tmpdir_env}
    first = NotebookKernel(env)
    second: NotebookKernel | None = None
    sleeper: subprocess.Popen[bytes] | None = None
    try:
        made = printed(first.run(LAUNCH))
        assert made["states"] == ["succeeded", "succeeded"], made
        job, kept = made["job"], made["kept"]
        assert os.path.dirname(job) == os.path.dirname(kept) == tmpdir_env
        with open(os.path.join(job, OWNER_FILE)) as fh:
            record = json.load(fh)
        assert record["pid"] == first.pid and record["owns_dir"] is True
        assert record["started"] == job_dirs.start_ticks(first.pid) and record["boot"] == job_dirs.this_boot()

        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while pid_running(first.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_running(first.pid)
        time.sleep(1)  # what the dead kernel could still have removed, it has
        assert os.path.isdir(job) and os.path.isdir(kept), "nothing is left to remove the killed kernel's folders"

        # a stale-looking folder that a process still names (a rank of an orphaned job may still run)
        busy = make(tmpdir_env, "clorch-job-90-busyxxxx", record)
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", f"{busy}/job.json"])
        me = {"pid": os.getpid(), "started": job_dirs.start_ticks(os.getpid()), "host": socket.gethostname(),
              "owns_dir": True, "boot": job_dirs.this_boot()}
        live = make(tmpdir_env, "clorch-job-91-livexxxx", me)
        reused = make(tmpdir_env, "clorch-job-92-reusedxx", {**me, "started": me["started"] - 3600 * os.sysconf("SC_CLK_TCK")})
        target = make(str(tmp_path), "elsewhere", record)
        link = os.path.join(tmpdir_env, "clorch-job-93-linkxxxx")
        os.symlink(target, link)

        second = NotebookKernel(env)
        ok(second.run(CAPTURE))
        ran = printed(second.run(SECOND))
        assert ran["state"] == "succeeded" and ran["losses"] == 2, ran
        assert not os.path.exists(job) and not os.path.exists(reused)
        assert any(line.startswith(f"swept job folder {job}:") for line in ran["log"]), ran["log"]
        for path in (kept, busy, live, ran["dir"]):
            assert os.path.isdir(path), path
        assert os.path.islink(link) and os.path.isdir(target)
        assert f"keeping job folder {busy}: a process (a rank or its supervisor) still names it" in ran["log"]
        assert f"keeping job folder {kept}: it lies in a caller's log_dir" in ran["log"]

        sleeper.kill()
        sleeper.wait(10)
        again = printed(second.run(SECOND))
        assert again["state"] == "succeeded"
        assert not os.path.exists(busy), again["log"]
        assert os.path.isdir(ran["dir"]), "the launching kernel lives: its earlier job's folder stays"
        assert os.path.isdir(kept) and os.path.isdir(live)
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(10)
        for kernel in (first, second):
            if kernel is not None:
                kernel.shutdown()
