"""Issue 36: sessions that outlive the notebook kernel (local launcher), through real notebook kernels.

A session is detached, its notebook kernel killed (SIGKILL), and a new kernel connects: the ranks'
variables, a collective and a DDP model's next step are there. Also: a second kernel is refused
while the first lives, then takes over with --take (the first is told); --keep-for expiry and
%clorch stop leave no process and no file; another local user cannot list, read or signal.
Each test has a runtime directory of its own (JUPYTER_RUNTIME_DIR), so sessions of other tests
running on this machine are never seen.
"""

from __future__ import annotations

import json
import os
import shutil
import pwd
import secrets
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import Iterator

import pytest

from clorch_repl.common.procs import pid_running, wait_gone

from notebook_kernel import NotebookKernel, Reply

START = "%clorch start --nproc 2 --backend gloo --name {name}"
SETUP = """%%distributed
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
x = rank * 10
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
def step():
    torch.manual_seed(100 + rank + len(losses))
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
step()
print('steps', len(losses))
"""
CHECK = """%%distributed
print('x is', x)
t = torch.tensor([rank + 1.0]); dist.all_reduce(t); print('sum', t.item())
step()
w = model.module.weight.detach().clone(); w0 = w.clone(); dist.broadcast(w0, 0)
print('same weights', torch.equal(w, w0), 'steps', len(losses))
"""


class Kernels:
    """Notebook kernels sharing one private runtime directory; all shut down at the end."""

    def __init__(self, runtime: str) -> None:
        self.runtime = runtime
        self.kernels: list[NotebookKernel] = []

    def new(self, keep_logs: bool = False) -> NotebookKernel:
        """``keep_logs``: its stops keep the rank logs, as by default outside the tests (conftest)."""
        kernel = NotebookKernel(env={"JUPYTER_RUNTIME_DIR": self.runtime, "CLORCH_KEEP_LOGS": "1" if keep_logs else "0"})
        self.kernels.append(kernel)
        ok(kernel.run("%load_ext clorch_repl"))
        return kernel

    def session_file(self, name: str) -> str:
        return os.path.join(self.runtime, "clorch", f"{name}.json")

    def record(self, name: str) -> dict:
        with open(self.session_file(name)) as fh:
            return json.load(fh)


def ok(reply: Reply) -> Reply:
    assert reply.status == "ok", reply.text
    return reply


def pids_of(record: dict) -> list[int]:
    return [r["pid"] for r in record["ranks"]] + [r["supervisor_pid"] for r in record["ranks"]]


@pytest.fixture()
def kernels(tmp_path) -> Iterator[Kernels]:
    made = Kernels(str(tmp_path / "runtime"))
    try:
        yield made
    finally:
        pids: list[int] = []
        for name in os.listdir(os.path.join(made.runtime, "clorch")) if os.path.isdir(
                os.path.join(made.runtime, "clorch")) else []:
            try:
                pids += pids_of(made.record(name[:-5]))
            except (OSError, ValueError, KeyError):
                pass
        for kernel in made.kernels:
            kernel.shutdown()
        for pid in pids:  # a failed test must not leave detached ranks for an hour
            if pid_running(pid):
                os.kill(pid, signal.SIGKILL)


def detached(kernels: Kernels, name: str, keep_for: str = "60s") -> tuple[NotebookKernel, dict]:
    first = kernels.new()
    ok(first.run(START.format(name=name)))
    assert "steps 1" in ok(first.run(SETUP)).text
    reply = ok(first.run(f"%clorch detach --keep-for {keep_for}"))
    assert f"session {name!r} detached" in reply.text, reply.text
    record = kernels.record(name)
    status = ok(first.run("%clorch status")).text
    assert f"session {name!r} is detached" in status and f"this kernel (pid {first.pid}) drives it" in status, status
    assert oct(os.stat(kernels.session_file(name)).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(kernels.session_file(name))).st_mode & 0o777) == "0o700"
    return first, record


def test_ranks_outlive_a_killed_notebook_and_a_new_kernel_drives_them(kernels: Kernels) -> None:
    first, record = detached(kernels, "train")
    # a cell running when the kernel dies finishes into the rank logs
    msg = first.send("%%distributed\nimport time\nprint('working', flush=True)\ntime.sleep(2)\n"
                     "print('finished while away', flush=True)")
    first.wait_for_ranks(msg, "working")
    os.kill(first.pid, signal.SIGKILL)
    time.sleep(3)
    assert all(pid_running(p) for p in pids_of(record)), "a detached session's ranks died with the notebook"

    second = kernels.new(keep_logs=True)
    waiting = ok(second.run("%clorch sessions")).text
    assert "train" in waiting and "2 x gloo" in waiting and f"pid {first.pid} (gone)" in waiting, waiting
    reply = ok(second.run("%clorch connect train"))
    assert "connected to session 'train': 2 gloo rank(s)" in reply.text, reply.text
    assert "finished while away" in reply.text, reply.text  # the logs' tail
    text = ok(second.run(CHECK)).text
    assert "x is 0" in text and "x is 10" in text, text
    assert "sum 3.0" in text, text
    assert text.count("same weights True steps 2") == 2 or "[ranks 0-1] same weights True steps 2" in text, text
    why = ok(second.run("%clorch why")).text
    # the connected kernel asks both ranks (their records: the collectives of the first kernel's cells)
    assert why.startswith("no collective is pending: ranks 0-1 are not running a cell"), why
    assert "all_reduce #" in why and "---- ranks 0-1 ----" in why, why
    msg = second.send("%%distributed\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)")
    second.wait_for_ranks(msg, "sleeping")
    second.km.interrupt_kernel()  # Kernel > Interrupt reaches ranks this kernel did not start
    interrupted = second.collect(msg, timeout=60)
    assert interrupted.status == "error" and "KeyboardInterrupt" in interrupted.text, interrupted.text
    status = ok(second.run("%clorch status")).text
    assert status.count(" idle ") == 2 and str(record["ranks"][1]["pid"]) in status, status
    assert (f"session 'train' is detached (its ranks outlive this kernel); this kernel (pid {second.pid}) drives "
            "it; kept 1 min once no kernel drives it") in status, status
    listed = ok(second.run("%clorch sessions")).text
    assert "train" in listed and f"pid {second.pid} (this kernel)" in listed, listed
    assert "GPU memory" in listed and "cpu" in listed, listed  # CPU ranks: no figure made up
    assert socket.gethostname() in listed, listed  # the hosts column: a detached session's ranks are here

    stopped = ok(second.run("%clorch stop"))
    assert "stopped 2 rank(s); their logs are kept in " in stopped.text, stopped.text
    assert wait_gone(pids_of(record), 10) == []
    assert not os.path.exists(record["dir"]) and not os.path.exists(kernels.session_file("train"))
    kept = stopped.text.split("their logs are kept in ")[1].split()[0]  # what they printed while away, too
    try:
        assert sorted(os.listdir(kept)) == ["rank0.log", "rank1.log"], os.listdir(kept)
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    assert "no detached sessions" in ok(second.run("%clorch sessions")).text


def test_a_second_kernel_is_refused_until_it_takes_over(kernels: Kernels) -> None:
    first, record = detached(kernels, "shared")
    second = kernels.new()
    refused = second.run("%clorch connect shared")
    assert refused.status == "error" and f"driven by the kernel with pid {first.pid}" in refused.text, refused.text
    ok(second.run("%clorch connect shared --take"))
    told = first.run("%%distributed\nprint('still mine?')")
    assert told.status == "error" and f"taken over by the kernel with pid {second.pid}" in told.text, told.text
    # a question, not a command that failed: it says so and succeeds (a notebook's Run All goes on past it)
    asked = first.run("%clorch status")
    assert asked.status == "ok" and (f"this kernel drives no ranks: session 'shared' was taken over by the kernel "
                                     f"with pid {second.pid}") in asked.text, asked.text
    assert "no ranks are running" in ok(first.run("%clorch status")).text  # it let go
    assert "x is 10" in ok(second.run("%%distributed\nprint('x is', x)")).text
    for restart, said in (("%clorch restart", "%clorch restart"), ("%clorch restart --ranks 1", "--ranks")):
        refused = second.run(restart)  # refused, saying why and what to do instead
        assert refused.status == "error" and f"{said} is not possible in a detached session" in refused.text \
            and "kept by no hold" in refused.text and "%clorch stop, then %clorch start --name NAME" in refused.text, \
            refused.text
    assert "x is 10" in ok(second.run("%%distributed\nprint('x is', x)")).text  # the ranks untouched
    first.shutdown()  # the first kernel's exit lets go; it never stops a session it no longer drives
    time.sleep(1)
    assert all(pid_running(p) for p in pids_of(record))
    ok(second.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []
    assert not os.path.exists(record["dir"]) and not os.path.exists(kernels.session_file("shared"))


def test_keep_for_expiry_frees_everything(kernels: Kernels) -> None:
    first, record = detached(kernels, "brief", keep_for="3s")
    os.kill(first.pid, signal.SIGKILL)
    time.sleep(1.5)
    assert all(pid_running(p) for p in pids_of(record)), "ended before --keep-for ran out"
    assert wait_gone(pids_of(record), 15) == [], "a detached session outlived its --keep-for"
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (os.path.exists(record["dir"]) or
                                           os.path.exists(kernels.session_file("brief"))):
        time.sleep(0.1)
    assert not os.path.exists(record["dir"]), "the session directory was left behind"
    assert not os.path.exists(kernels.session_file("brief")), "the session file was left behind"


def test_keep_for_counts_once_the_driver_is_gone_though_the_first_kernel_lives(kernels: Kernels) -> None:
    """The kernel that started the ranks (their supervisors' parent) was taken over and lives on
    idle: it holds nothing, so the session still ends keep-for after its driver died."""
    first, record = detached(kernels, "handed", keep_for="3s")
    second = kernels.new()
    ok(second.run("%clorch connect handed --take"))
    os.kill(second.pid, signal.SIGKILL)
    left = wait_gone(pids_of(record), 30)
    assert left == [], ("the first kernel's life kept a session it does not drive",
                        subprocess.run(["ps", "-o", "pid,ppid,stat,etime,args", "-p", ",".join(map(str, left))],
                                       capture_output=True, text=True).stdout)
    assert first.km.is_alive()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(kernels.session_file("handed")):
        time.sleep(0.1)
    assert not os.path.exists(record["dir"]) and not os.path.exists(kernels.session_file("handed"))
    told = first.run("%clorch status")
    assert "was stopped from another kernel" in told.text or "no ranks are running" in told.text, told.text


def test_connect_waits_for_a_cell_the_killed_kernel_left_running(kernels: Kernels) -> None:
    first, record = detached(kernels, "busy")
    msg = first.send("%%distributed\nimport time\nprint('working', flush=True)\ntime.sleep(6)\ny = 5\n"
                     "print('done late', flush=True)")
    first.wait_for_ranks(msg, "working")
    os.kill(first.pid, signal.SIGKILL)
    second = kernels.new()
    reply = ok(second.run("%clorch connect busy"))
    assert "the ranks are busy" in reply.text and "done late" in reply.text, reply.text
    assert "y is 5" in ok(second.run("%%distributed\nprint('y is', y)")).text
    ok(second.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


HANG = "%%distributed --timeout 3\nimport time\nif rank == 0:\n    time.sleep(3600)\nelse:\n    dist.barrier()\n"
FORMED = "the group was aborted and formed again"


def test_the_group_re_forms_from_the_new_kernel_under_the_next_generation(kernels: Kernels) -> None:
    """A hang freed by aborting the group re-forms it in place under clorch-regroup/<generation>:
    the connecting kernel goes on counting from the first kernel's, else it would meet stale keys."""
    first, record = detached_after(kernels, "regrouped", before=HANG)
    assert record["generation"] == 1, record
    os.kill(first.pid, signal.SIGKILL)
    second = kernels.new()
    connected = ok(second.run("%clorch connect regrouped")).text
    assert "generation 1" in connected, connected
    # the logs' tail holds the hang's interrupted traceback: shown as text, as %clorch logs shows it
    assert "KeyboardInterrupt" in connected and "\x1b[" not in connected, repr(connected)
    hung = second.run(HANG, timeout=120)
    assert hung.status == "error" and FORMED in hung.text, hung.text
    text = ok(second.run(CHECK)).text
    assert "sum 3.0" in text and "same weights True steps 2" in text, text
    assert kernels.record("regrouped")["generation"] == 2  # saved at once: this kernel may die next
    os.kill(second.pid, signal.SIGKILL)
    third = kernels.new()
    assert "generation 2" in ok(third.run("%clorch connect regrouped")).text
    hung = third.run(HANG, timeout=120)
    assert hung.status == "error" and FORMED in hung.text, hung.text
    assert "same weights True steps 3" in ok(third.run(CHECK)).text
    ok(third.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


def detached_after(kernels: Kernels, name: str, before: str) -> tuple[NotebookKernel, dict]:
    first = kernels.new()
    ok(first.run(START.format(name=name)))
    ok(first.run(SETUP))
    hung = first.run(before, timeout=120)
    assert hung.status == "error" and FORMED in hung.text, hung.text
    ok(first.run(f"%clorch detach --keep-for 60s"))
    return first, kernels.record(name)


NOTICED = "no progress on any rank"
STUCK = ("%%distributed --timeout 8\nimport time\nif rank == 0:\n    dist.all_reduce(torch.ones(1))\nelse:\n"
         "    time.sleep(3600)\n")


def test_the_sessions_hang_notice_outlives_detach_and_connect(kernels: Kernels) -> None:
    """``%clorch start --hang-notice S`` is the session's default: the kernel that detached it and a
    kernel that connects use it too (a cell that gives none says why it is stuck after S, not 30 s)."""
    first = kernels.new()
    ok(first.run("%clorch start --nproc 2 --backend gloo --name noticed --hang-notice 2"))
    ok(first.run(SETUP))
    ok(first.run("%clorch detach --keep-for 60s"))
    hung = first.run(STUCK, timeout=120)
    assert hung.status == "error" and NOTICED in hung.text, hung.text
    record = kernels.record("noticed")
    assert record["hang_notice_s"] == 2.0, record
    os.kill(first.pid, signal.SIGKILL)
    second = kernels.new()
    ok(second.run("%clorch connect noticed"))
    hung = second.run(STUCK, timeout=120)
    assert hung.status == "error" and NOTICED in hung.text, hung.text
    ok(second.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


ARM_IDLE_SUSPEND = ("from clorch_repl.magics import magics_for\nfrom clorch_repl.magics.suspend import set_idle_suspend\n"
                    "print(set_idle_suspend(magics_for(get_ipython()), 600.0))")


def test_the_sessions_suspend_after_outlives_detach_and_connect(kernels: Kernels) -> None:
    """``%clorch start --suspend-after 10m`` then ``%clorch detach``: a kernel that connected did not
    suspend the ranks by themselves (the setting stayed in the first kernel). Now it is in the
    session file and connect arms it again. Here CPU ranks, which ``--suspend-after`` refuses (they
    hold no GPU): the idle suspend is armed as that option arms it; the suspend itself needs a GPU
    (tests/gpu/test_gpu_suspend.py)."""
    first = kernels.new()
    ok(first.run(START.format(name="sleepy")))
    assert "suspends by itself once no cell has run for 10m00s" in ok(first.run(ARM_IDLE_SUSPEND)).text
    ok(first.run("%clorch detach --keep-for 60s"))
    record = kernels.record("sleepy")
    assert record["suspend_after_s"] == 600.0, record
    os.kill(first.pid, signal.SIGKILL)
    second = kernels.new()
    connected = ok(second.run("%clorch connect sleepy")).text
    assert "the session suspends by itself once no cell has run for 10m00s" in connected, connected
    ok(second.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


def test_a_dead_rank_of_a_detached_session_says_how_it_ended_and_what_works(kernels: Kernels) -> None:
    """Its supervisor writes the exit status down (the connected kernel cannot wait for the rank);
    and a detached session cannot start ranks again, so no notice advises %clorch restart --ranks."""
    first, record = detached(kernels, "dying")
    os.kill(first.pid, signal.SIGKILL)
    second = kernels.new()
    ok(second.run("%clorch connect dying"))
    died = second.run("%%distributed\nimport os\nif rank == 1:\n    os._exit(5)\nt = torch.ones(1)\n"
                      "dist.all_reduce(t)\n", timeout=120)
    assert died.status == "error" and "rank 1 died (exit code 5)" in died.text, died.text
    instead = "a detached session cannot start rank 1 again (%clorch restart is refused there): for fresh ranks, "
    # the report's own advice too (its last line said --ranks 1, which this session refuses)
    assert "--ranks" not in died.text and instead in " ".join(died.text.split()), died.text
    after = ok(second.run("%%distributed\nprint('kept', x)"))
    assert "[rank 0] kept 0" in after.text and instead in after.text, after.text
    assert "--ranks" not in after.text, after.text
    refused = second.run("%%distributed --ranks 1\nprint('anyone?')")
    assert refused.status == "error" and "rank 1 (exit code 5) is dead: " + instead in " ".join(refused.text.split()), \
        refused.text
    assert "dead (exit code 5)" in ok(second.run("%clorch status")).text
    ok(second.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


def test_a_clean_exit_of_the_notebook_kernel_keeps_a_detached_session(kernels: Kernels) -> None:
    first, record = detached(kernels, "restarted")
    first.shutdown()  # what Kernel > Restart does to the old kernel: its atexit runs
    time.sleep(1.5)
    assert all(pid_running(p) for p in pids_of(record))
    second = kernels.new()
    # the new kernel's first cell names the session and how to reach it (not just "%clorch start")
    hint = "your detached session 'restarted' runs on this host: %clorch connect restarted drives it from here"
    for line in ("%clorch status", "%%distributed\nprint(1)"):
        said = " ".join(second.run(line).text.split())
        assert "no ranks are running" in said and hint in said, (line, said)
    ok(second.run("%clorch connect"))  # the only session: no name needed
    again = ok(second.run("%clorch connect restarted"))  # connected already: said, nothing undone
    assert "this kernel drives session 'restarted' already" in again.text, again.text
    assert "x is 0" in ok(second.run("%%distributed --ranks 0\nprint('x is', x)")).text
    ok(second.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


def test_detach_input_is_checked(kernels: Kernels) -> None:
    first = kernels.new()
    assert "no ranks are running" in first.run("%clorch detach").text
    missing = first.run("%clorch connect nothing-here")
    assert missing.status == "error" and "no detached session called 'nothing-here'" in missing.text, missing.text
    bad = first.run("%clorch start --nproc 2 --backend gloo --name 'a b'")
    assert bad.status == "error" and "session name" in bad.text, bad.text
    ok(first.run("%clorch start --nproc 2 --backend gloo"))
    for line, said in (("%clorch detach --keep-for 0", "--keep-for must be a duration"),
                       ("%clorch detach --keep-for soon", "--keep-for must be a duration"),
                       ("%clorch detach --name ../x", "session name '../x' must be"),
                       ("%clorch connect other", "this kernel drives the ranks it started already")):
        reply = first.run(line)
        assert reply.status == "error" and said in reply.text, (line, reply.text)
    ok(first.run("%clorch stop"))


ATTACK = textwrap.dedent("""
    import json, os, sys
    uid, gid, runtime, session_file, pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    os.setgid(gid); os.setuid(uid)
    got = {}
    for what, act in (("list", lambda: os.listdir(runtime)), ("read", lambda: open(session_file).read()),
                      ("signal", lambda: os.kill(pid, 0))):
        try:
            act(); got[what] = "allowed"
        except OSError as exc:
            got[what] = type(exc).__name__
    print(json.dumps(got))
""")


def test_another_local_user_cannot_list_read_or_signal(kernels: Kernels) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root, to create a second local user with useradd")
    if subprocess.run(["which", "useradd"], capture_output=True).returncode != 0:
        pytest.skip("useradd is not installed")
    first, record = detached(kernels, "private")
    name = f"clorch{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    try:
        user = pwd.getpwnam(name)
        out = subprocess.run([sys.executable, "-c", ATTACK, str(user.pw_uid), str(user.pw_gid),
                              os.path.join(kernels.runtime, "clorch"), kernels.session_file("private"),
                              str(record["ranks"][0]["pid"])], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got == {"list": "PermissionError", "read": "PermissionError", "signal": "PermissionError"}, got
    finally:
        subprocess.run(["userdel", name], capture_output=True)
    ok(first.run("%clorch stop"))
    assert wait_gone(pids_of(record), 10) == []


PROMPT = r"In \[\d+\]: "


def test_jupyter_console_connects_and_runs_a_cell_on_the_ranks(kernels: Kernels) -> None:
    """A real ``jupyter console`` (its own kernel, under a pseudo-terminal: pexpect) drives the
    ranks a killed notebook kernel detached: it sees the variables that kernel set."""
    import pexpect

    first, record = detached(kernels, "console")
    ok(first.run("%%distributed\nfrom_notebook = f'set in the notebook on rank {rank}'"))
    os.kill(first.pid, signal.SIGKILL)
    console = pexpect.spawn(
        os.path.join(os.path.dirname(sys.executable), "jupyter-console"),
        ["--simple-prompt", "--no-confirm-exit", "--kernel", "python3"],
        env=dict(os.environ, JUPYTER_RUNTIME_DIR=kernels.runtime, TERM="dumb"), encoding="utf-8", timeout=120,
        dimensions=(50, 200))
    try:
        console.expect(PROMPT)
        console.sendline("%load_ext clorch_repl")
        console.expect(PROMPT)
        console.sendline("%clorch connect console")
        console.expect("connected to session 'console': 2 gloo rank\\(s\\)")
        console.expect(PROMPT)
        # jupyter console's simple prompt (the one a pseudo-terminal can drive) reads one line per
        # cell, so the %%distributed cell is run as IPython runs any cell magic
        console.sendline("get_ipython().run_cell_magic('distributed', '', \"print(from_notebook, 'x is', x)\")")
        console.expect(PROMPT)
        ran = console.before
        assert "set in the notebook on rank 0 x is 0" in ran and "set in the notebook on rank 1 x is 10" in ran, ran
        console.sendline("%clorch stop")
        console.expect("stopped 2 rank\\(s\\)")
        console.expect(PROMPT)
        console.sendline("exit")
        console.expect(pexpect.EOF)
    finally:
        console.close(force=True)
    assert wait_gone(pids_of(record), 10) == []
    assert not os.path.exists(record["dir"]) and not os.path.exists(kernels.session_file("console"))
